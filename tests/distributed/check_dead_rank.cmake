# Runs DataParallel.DeadRankEndsTheJob under mpirun with one rank killed or hung (MODE kill|hang) and
# checks that the job ends with a non-zero status, within LIMIT seconds, saying why.
# -DMPIEXEC=... -DTEST_BINARY=... -DMODE=kill|hang -DLIMIT=<seconds>
string(TIMESTAMP start "%s")
execute_process(
  COMMAND ${MPIEXEC} -np 2 --oversubscribe --bind-to none --timeout 300 -x PS_DEAD_RANK=${MODE}
          -x PATRICKSTAR_COMM_TIMEOUT_S=5 ${TEST_BINARY} --gtest_filter=DataParallel.DeadRankEndsTheJob
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(TIMESTAMP end "%s")
math(EXPR elapsed "${end} - ${start}")
set(all "${out}\n${err}")
message(STATUS "mpirun exited with ${rc} after ${elapsed} s")
if(rc EQUAL 0)
  message(FATAL_ERROR "the job with a ${MODE} rank exited 0:\n${all}")
endif()
if(elapsed GREATER ${LIMIT})
  message(FATAL_ERROR "the job with a ${MODE} rank took ${elapsed} s (limit ${LIMIT} s):\n${all}")
endif()
if(MODE STREQUAL "hang")
  # The surviving rank names its collective and itself.
  if(NOT all MATCHES "patrickstar: rank 0 of 2: MPI_[A-Za-z_]+ \\(collective #[0-9]+ of this rank\\) did not complete within 5 s")
    message(FATAL_ERROR "no deadline message from rank 0:\n${all}")
  endif()
else()
  if(NOT all MATCHES "signal 9|Killed|killed")
    message(FATAL_ERROR "mpirun did not report the killed rank:\n${all}")
  endif()
endif()
if(all MATCHES "went on past a dead rank")
  message(FATAL_ERROR "a rank trained on past the dead one:\n${all}")
endif()
message(STATUS "${all}")
