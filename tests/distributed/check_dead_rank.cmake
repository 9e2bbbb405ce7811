# Runs DataParallel.DeadRankEndsTheJob under mpirun (or, with -DTORCHRUN, torchrun and the store
# backend) with one rank killed or hung (MODE kill|hang) and checks that the job ends with a
# non-zero status, within LIMIT seconds, saying why.
# -DMPIEXEC=... | -DTORCHRUN="<python> -m torch.distributed.run"; -DTEST_BINARY=... -DMODE=kill|hang
# -DLIMIT=<seconds>
string(TIMESTAMP start "%s")
if(TORCHRUN)
  separate_arguments(torchrun UNIX_COMMAND "${TORCHRUN}")
  set(ENV{PS_DEAD_RANK} ${MODE})
  set(ENV{PATRICKSTAR_COMM_TIMEOUT_S} 5)
  set(ENV{PATRICKSTAR_COMM_BACKEND} store)
  execute_process(
    COMMAND ${torchrun} --standalone --nnodes 1 --nproc_per_node 2 --no-python ${TEST_BINARY}
            --gtest_filter=DataParallel.DeadRankEndsTheJob
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
else()
  execute_process(
    COMMAND ${MPIEXEC} -np 2 --oversubscribe --bind-to none --timeout 300 -x PS_DEAD_RANK=${MODE}
            -x PATRICKSTAR_COMM_TIMEOUT_S=5 ${TEST_BINARY} --gtest_filter=DataParallel.DeadRankEndsTheJob
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
endif()
string(TIMESTAMP end "%s")
math(EXPR elapsed "${end} - ${start}")
set(all "${out}\n${err}")
message(STATUS "the launcher exited with ${rc} after ${elapsed} s")
if(rc EQUAL 0)
  message(FATAL_ERROR "the job with a ${MODE} rank exited 0:\n${all}")
endif()
if(elapsed GREATER ${LIMIT})
  message(FATAL_ERROR "the job with a ${MODE} rank took ${elapsed} s (limit ${LIMIT} s):\n${all}")
endif()
if(MODE STREQUAL "hang" AND TORCHRUN)
  # The surviving rank's collective throws, naming it and the rank.
  if(NOT all MATCHES "patrickstar: rank 0 of 2: [a-z_]+ \\(collective #[0-9]+ of this group\\) failed")
    message(FATAL_ERROR "no error from rank 0's collective:\n${all}")
  endif()
elseif(MODE STREQUAL "kill" AND TORCHRUN)
  if(NOT all MATCHES "SIGKILL|Signal 9|signal 9|exitcode *: *-9")
    message(FATAL_ERROR "torchrun did not report the killed rank:\n${all}")
  endif()
elseif(MODE STREQUAL "hang")
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
