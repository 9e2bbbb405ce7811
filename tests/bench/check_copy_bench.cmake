# Runs ps_copy_bench on DEVICE (emulated or cuda) with small payloads and checks that it measured
# every way in both directions and that the bytes came back identical. Where DEVICE cannot run
# (cuda without a GPU) ps_copy_bench exits 3 saying "nothing measured", which ctest reports as a
# skip. Args: PS_COPY_BENCH, DEVICE, OUT (a JSON path).
execute_process(
  COMMAND "${PS_COPY_BENCH}" --device ${DEVICE} --chunk-bytes 4MiB --chunks 4 --rounds 2
          --json "${OUT}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 3)
  message(STATUS "${out}")  # "... nothing measured": a skip, never a pass
  return()
endif()
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ps_copy_bench --device ${DEVICE} failed (exit ${rc}):\n${out}\n${err}")
endif()
message(STATUS "${out}")
file(READ "${OUT}" json)
string(JSON intact GET "${json}" round_trip_identical)
if(NOT intact)
  message(FATAL_ERROR "ps_copy_bench: the bytes changed on the round trip")
endif()
foreach(direction h2d d2h)
  foreach(key reference_gbps waited_gbps queued_gbps waited_ratio queued_ratio)
    string(JSON value GET "${json}" ${direction} ${key})
    if(NOT value GREATER 0)
      message(FATAL_ERROR "ps_copy_bench: ${direction} ${key} is ${value} (expected > 0)")
    endif()
  endforeach()
endforeach()
