# Runs ps_bench --compare-plan on gpt_tiny with the delayed update allowed (plan_delayed.json):
# every candidate the plan considered trains pinned in its own engine beside the planning engine,
# and each engine's losses equal those of its kind (the exact step's, or the delayed update's);
# a delayed candidate is among them and trained. No timing is asserted (BENCHMARKS.md has those).
# Args: PS_BENCH, CONFIG, OUT (a JSON path).
execute_process(
  COMMAND "${PS_BENCH}" --model gpt_tiny --batch 2 --seq 16 --steps 8 --device emulated:2400000
          --compare-plan --config "${CONFIG}" --json "${OUT}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ps_bench --compare-plan failed (exit ${rc}):\n${out}\n${err}")
endif()
file(READ "${OUT}" json)
string(JSON equal GET "${json}" losses_equal)
if(NOT equal)
  message(FATAL_ERROR "ps_bench --compare-plan: an engine's losses differ from its kind's:\n${out}")
endif()
string(JSON n LENGTH "${json}" candidates)
set(delayed_trained FALSE)
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  string(JSON name GET "${json}" candidates ${i} name)
  string(JSON measured ERROR_VARIABLE untrained GET "${json}" candidates ${i} measured_step_s)
  if(name MATCHES ", delayed," AND NOT untrained)
    set(delayed_trained TRUE)
  endif()
endforeach()
if(NOT delayed_trained)
  message(FATAL_ERROR "ps_bench --compare-plan: no delayed candidate trained:\n${out}")
endif()
string(JSON to_best GET "${json}" plan_to_best)
message(STATUS "compare-plan: ${n} candidates, a delayed one trained, losses equal by kind, "
               "plan / best ${to_best}")
