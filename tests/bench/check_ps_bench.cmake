# Runs ps_bench with --baseline on a small model under a device that forces chunk moves and checks
# that its losses match plain LibTorch's (fp32: relative difference <= 1e-5 at every step), so the
# main job never reports speed for wrong training. Args: PS_BENCH, OUT (a JSON path).
execute_process(
  COMMAND "${PS_BENCH}" --model gpt_tiny --batch 4 --seq 16 --steps 4 --device emulated:2400000
          --chunk-size 40000 --baseline --json "${OUT}"
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
