# Runs ps_bench --find-max-model on gpt_tiny's shape under small device and host budgets and checks
# the JSON: both policies found a trainable size, and opt trains at least as large a model as static
# (opt may use the whole device for any chunk; static must hold every parameter chunk there).
# Args: PS_BENCH, OUT (a JSON path).
execute_process(
  COMMAND "${PS_BENCH}" --find-max-model --model gpt_tiny --dtype bf16 --batch 1 --seq 16
          --device emulated:1MiB --host-memory 16MiB --chunk-size auto --max-layers 64
          --json "${OUT}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ps_bench --find-max-model failed (exit ${rc}):\n${out}\n${err}")
endif()
file(READ "${OUT}" json)
string(JSON count LENGTH "${json}" results)
if(NOT count EQUAL 2)
  message(FATAL_ERROR "expected results for 2 policies, got ${count}:\n${out}")
endif()
foreach(i 0 1)
  string(JSON policy GET "${json}" results ${i} policy)
  string(JSON layers GET "${json}" results ${i} max_layers)
  string(JSON params GET "${json}" results ${i} params)
  set(${policy}_layers ${layers})
  set(${policy}_params ${params})
endforeach()
message(STATUS "find-max-model: opt ${opt_layers} layers (${opt_params} params), static "
               "${static_layers} layers (${static_params} params)")
if(NOT opt_layers GREATER 0 OR NOT static_layers GREATER 0)
  message(FATAL_ERROR "a policy found no trainable size:\n${out}")
endif()
if(opt_params LESS static_params)
  message(FATAL_ERROR "opt trains a smaller model than static:\n${out}")
endif()
if(opt_layers EQUAL 64)
  message(FATAL_ERROR "opt reached --max-layers: the budgets did not limit the search:\n${out}")
endif()
