# ps_bench with dropout inside checkpointed blocks against plain LibTorch (--baseline): the recompute
# replays the forward's masks, so the engine's losses equal the baseline's within 1e-6 relative at
# every step (fp32, a device that forces moves), in one process or under mpirun (LAUNCH: the
# launcher's command line, ";"-separated; the baseline then trains the ranks' rows as micro-batches
# from one random state, as the ranks draw them). Args: PS_BENCH, OUT (a JSON path), LAUNCH.
execute_process(
  COMMAND ${LAUNCH} "${PS_BENCH}" --model gpt_tiny --batch 4 --seq 16 --steps 4
          --device emulated:2400000 --chunk-size 40000 --dropout 0.1 --checkpoint-activations
          --baseline --json "${OUT}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ps_bench failed (exit ${rc}):\n${out}\n${err}")
endif()
file(READ "${OUT}" json)
string(JSON worst GET "${json}" max_relative_loss_difference)
string(JSON dropout GET "${json}" dropout)
string(JSON checkpointed GET "${json}" checkpoint_activations)
string(JSON world GET "${json}" world_size)
string(JSON h2d GET "${json}" h2d_bytes_per_iter)
string(JSON steps LENGTH "${json}" losses)
message(STATUS "ps_bench --dropout ${dropout} --checkpoint-activations, ${world} rank(s): ${steps} "
               "steps, max relative loss difference to plain LibTorch ${worst}, h2d per iteration ${h2d}")
if(NOT dropout EQUAL 0.1 AND NOT dropout STREQUAL "0.1")
  message(FATAL_ERROR "ps_bench ran with dropout ${dropout}, expected 0.1")
endif()
if(NOT checkpointed OR NOT steps EQUAL 4)
  message(FATAL_ERROR "ps_bench: checkpoint_activations ${checkpointed}, ${steps} steps")
endif()
if(worst GREATER 0.000001)
  message(FATAL_ERROR "ps_bench: with dropout in checkpointed blocks the losses differ from plain "
                      "LibTorch by ${worst} (> 1e-6)")
endif()
if(h2d LESS_EQUAL 0)
  message(FATAL_ERROR "ps_bench: no chunk moved (h2d ${h2d}); the device should force moves")
endif()
