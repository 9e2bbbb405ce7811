#!/usr/bin/env python3
"""DeepSpeed's CPU Adam (DeepSpeedCPUAdam, from PyPI) on the sizes of benchmarks/micro/adam_bench.cpp,
so the comparison with the best-known CPU Adam is measured on this machine, not quoted.

Run it in a virtual environment of its own: `pip install deepspeed` brings the newest torch, which
must not replace the pinned LibTorch in the project's .venv.
  python3 -m venv /tmp/ds-venv && /tmp/ds-venv/bin/pip install deepspeed   # once; DeepSpeed
                                             # JIT-compiles its CPU Adam with ninja on first use
  flock /tmp/ps-build.lock /tmp/ds-venv/bin/python scripts/bench_deepspeed_adam.py [--params 67108864]

Prints one line per case with parameters/s, the same unit as ps_micro's items_per_second:
  DS_CpuAdam_Fp32:              fp32 params, fp32 grads (DeepSpeed's step()); compare with
                                BM_CpuAdam_Fp32.
  DS_CpuAdam_Fp32StepPlusCasts: not a DeepSpeed kernel of its own. DeepSpeed 0.19's step() has no
                                fused 16-bit write-back (it takes the fp32 master and an fp32
                                gradient), so this is its fp32 step() between a bf16 -> fp32
                                gradient cast and an fp32 -> bf16 weight copy, the work ZeRO-Offload
                                does around it; compare with BM_CpuAdam_Mixed and
                                BM_AtenFusedAdamW_Mixed, which do the same work.
Threads: torch.get_num_threads() (DeepSpeed's kernel uses OpenMP with the same default).
"""
import argparse
import time

import torch


def timed(fn, min_time_s):
    fn()  # warm-up (first touch, JIT)
    iterations, start = 0, time.perf_counter()
    while True:
        fn()
        iterations += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s:
            return elapsed / iterations


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=64 << 20)
    parser.add_argument("--min-time", type=float, default=2.0)
    args = parser.parse_args()

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    n = args.params
    lr, betas, eps, wd = 1e-3, (0.9, 0.999), 1e-8, 0.01

    # fp32
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, adamw_mode=True)
    t = timed(opt.step, args.min_time)
    print(f"DS_CpuAdam_Fp32   params={n} time_ms={t * 1e3:.1f} items_per_second={n / t / 1e9:.3f}G "
          f"threads={torch.get_num_threads()}")
    del opt, p

    # DeepSpeed's fp32 step() plus the casts of a mixed-precision step: bf16 gradient in, bf16 weight
    # out, fp32 master/m/v
    master = torch.nn.Parameter(torch.randn(n))
    master.grad = torch.empty(n)
    half = torch.randn(n).to(torch.bfloat16)
    opt = DeepSpeedCPUAdam([master], lr=lr, betas=betas, eps=eps, weight_decay=wd, adamw_mode=True)

    def fp32_step_plus_casts():
        master.grad.copy_(half)
        opt.step()
        half.copy_(master.data)

    t = timed(fp32_step_plus_casts, args.min_time)
    print(f"DS_CpuAdam_Fp32StepPlusCasts  params={n} time_ms={t * 1e3:.1f} items_per_second={n / t / 1e9:.3f}G "
          f"threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
