# Runs ps_bench with --baseline on a small model under a device that forces chunk moves and checks
# that its losses match plain LibTorch's (fp32: relative difference <= 1e-5 at every step), so the
# main job never reports speed for wrong training; also that the memory breakdown, the process
# line and the GPU prediction reach the JSON. Args: PS_BENCH, OUT (a JSON path).
execute_process(
  COMMAND "${PS_BENCH}" --model gpt_tiny --batch 4 --seq 16 --steps 4 --device emulated:2400000
          --chunk-size 40000 --baseline --predict h100 --json "${OUT}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ps_bench failed (exit ${rc}):\n${out}\n${err}")
endif()
file(READ "${OUT}" json)
string(JSON worst GET "${json}" max_relative_loss_difference)
string(JSON steps LENGTH "${json}" losses)
string(JSON baseline_steps LENGTH "${json}" baseline_losses)
string(JSON h2d GET "${json}" h2d_bytes_per_iter)
message(STATUS "ps_bench: ${steps} steps, max relative loss difference ${worst}, h2d per iteration ${h2d}")
if(NOT steps EQUAL 4 OR NOT baseline_steps EQUAL 4)
  message(FATAL_ERROR "ps_bench wrote ${steps} engine and ${baseline_steps} baseline losses, expected 4")
endif()
if(worst GREATER 0.00001)
  message(FATAL_ERROR "ps_bench: engine losses differ from plain LibTorch by ${worst} (> 1e-5)")
endif()
if(h2d LESS_EQUAL 0)
  message(FATAL_ERROR "ps_bench: no chunk moved (h2d ${h2d}); the device should force moves")
endif()
foreach(key model params chunk_waste_fraction model_data_bytes_per_param device_peak_bytes
            d2h_bytes_per_iter step_time_s samples_per_s tflops_ps tflops_megatron
            adam_chunks_device adam_chunks_host policy baseline_step_time_s)
  string(JSON value ERROR_VARIABLE missing GET "${json}" ${key})
  if(missing)
    message(FATAL_ERROR "ps_bench JSON lacks \"${key}\"")
  endif()
endforeach()
foreach(path "memory_at_device_peak;device_total_bytes" "memory_at_host_peak;host_used_bytes"
             "prediction;step_s" "prediction;exposed_copy_s" "process_hwm_bytes" "accounted_bytes")
  string(JSON value ERROR_VARIABLE missing GET "${json}" ${path})
  if(missing)
    message(FATAL_ERROR "ps_bench JSON lacks ${path}")
  endif()
endforeach()
# The prediction's FLOPs: 6 per parameter per token at most (2 forward, 4 backward), the position
# embedding's lookups doing none; 4 x 16 tokens.
string(JSON params GET "${json}" params)
string(JSON flops GET "${json}" prediction flops_per_iteration)
string(JSON predicted_step GET "${json}" prediction step_s)
math(EXPR most "6 * ${params} * 64")
if(flops LESS_EQUAL 0 OR flops GREATER most OR predicted_step LESS_EQUAL 0)
  message(FATAL_ERROR "ps_bench --predict h100: ${flops} FLOPs per iteration (expected in (0, ${most}]), "
                      "step ${predicted_step} s")
endif()
