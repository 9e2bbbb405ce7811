"""gpu-check's steps, in order of value: what each runs on a GPU, and on the emulated device with
--dry-run (the same command where the device is a flag; where the GPU command trains a model only a
GPU holds, the dry run checks that exact command line with ps_bench --check-flags and trains a small
model with the same flags otherwise, so the report's figures are read from a real run)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET

TARGET_PATHS = {"ps_copy_bench": "benchmarks/ps_copy_bench", "engine_tests": "tests/engine_tests",
                "memtracer_tests": "tests/memtracer_tests", "chunk_tests": "tests/chunk_tests",
                "optimizer_tests": "tests/optimizer_tests", "ps_bench": "benchmarks/ps_bench",
                "ps_micro": "benchmarks/ps_micro", "distributed_tests": "tests/distributed_tests",
                "comm_tests": "tests/comm_tests"}
TARGETS = list(TARGET_PATHS)
RESERVE_S = 6  # kept back from every step for the report and the archive
SANITIZED_TEST = "EngineTraining.HybridAdamRunsOnTheDeviceWhenTheModelFits"  # Adam on the device


class Step:
    def __init__(self, name, fn, timeout, min_seconds, always=False):
        self.name, self.fn, self.timeout, self.min_seconds, self.always = \
            name, fn, timeout, min_seconds, always


class Context:
    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.current, self.proc, self.no_gpu, self.bins, self.env = None, None, False, None, None
        self.torch, self.stalled = {}, False

    def remaining(self):
        return self.deadline_at - time.time() - RESERVE_S

    def run_step(self, step):
        rep = self.rep
        if self.no_gpu and not step.always:
            rep.finish(step.name, "skipped", "no GPU here")
            return
        if step.name != "binaries" and not step.always and self.bins is None:
            rep.finish(step.name, "skipped", "no binaries to run (see the binaries step)")
            return
        left = self.remaining()
        if left < step.min_seconds:
            rep.finish(step.name, "skipped", "needs %d s, %.0f s left before the deadline"
                       % (step.min_seconds, left), deadline=True)
            self.say("%s: skipped (deadline)" % step.name)
            return
        self.current, self.step_ends = step.name, time.time() + min(step.timeout, left)
        rep.start(step.name)
        self.say("%s (up to %.0f s) ..." % (step.name, min(step.timeout, left)))
        try:
            status, detail, figures, tests = step.fn(self)
        except Exception as e:  # noqa: BLE001  our own bug must not cost the rest of the window
            log = os.path.join(self.logs, step.name + "-gpu-check-error.log")
            with open(log, "w") as f:
                f.write(traceback.format_exc())
            rep.add_log(step.name, log)
            status, detail, figures, tests = "failed", "gpu-check's own error: %r" % e, {}, None
        rep.finish(step.name, status, detail, figures, tests)
        self.say("%s: %s%s" % (step.name, status, " (%s)" % detail if detail else ""))
        if status in ("failed", "timed_out"):
            for log in rep.step(step.name)["logs"]:
                if log.endswith(".log"):
                    print_tail(os.path.join(self.logs, log))
        self.current = None

    def command(self, label, argv, env=None, timeout=None):
        """Runs argv under the step's remaining time (or less); its output in the step's log.
        Returns the exit status, "timeout", or "missing" (argv[0] absent)."""
        log = os.path.join(self.logs, "%s-%s.log" % (self.current, label))
        self.rep.add_log(self.current, log)
        limit = max(1.0, min(timeout or 1e9, self.step_ends - time.time()))
        if self.stall == self.current and not self.stalled:  # testing: this command hangs
            self.stalled = True
            argv, limit = [sys.executable, "-c", "import time; time.sleep(100000)"], \
                min(self.stall_timeout, max(1.0, self.step_ends - time.time()))
        full_env = dict(os.environ, **(self.env or {}), **(env or {}))
        with open(log, "w") as out:
            out.write("$ %s\n" % " ".join(argv))
            out.flush()
            try:
                self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                             env=full_env, start_new_session=True)
            except OSError as e:
                out.write("cannot run: %s\n" % e)
                return "missing"
            try:
                return self.proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                out.write("\ngpu-check: killed after %.0f s (its timeout)\n" % limit)
                self.kill_current()
                return "timeout"
            except BaseException:  # interrupted (a signal): the command goes with us
                self.kill_current()
                raise
            finally:
                self.proc = None

    def kill_current(self):
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue

    def log_path(self, name):
        path = os.path.join(self.logs, "%s-%s" % (self.current, name))
        self.rep.add_log(self.current, path)
        return path


def print_tail(path, lines=25):
    try:
        with open(path, errors="replace") as f:
            tail = f.readlines()[-lines:]
    except OSError:
        return
    print("---- last %d lines of %s" % (len(tail), os.path.basename(path)))
    sys.stdout.write("".join(tail))
    print("----", flush=True)


def outcome(rc, what):
    if rc == 0:
        return "passed", ""
    if rc == "timeout":
        return "timed_out", what + " ran past its timeout"
    return "failed", "%s exited with %s" % (what, rc)


# ---------------------------------------------------------------------------------------------
# facts and binaries

def facts(ctx):
    f = {}

    def first(argv, pattern=None):
        rc, out = capture(argv)
        if rc != 0 or not out:
            return "absent"
        lines = [l for l in out.splitlines() if not pattern or re.search(pattern, l)]
        return (lines or out.splitlines())[0].strip()
    try:
        with open("/etc/os-release") as osr:
            f["os"] = re.search(r'PRETTY_NAME="?([^"\n]*)', osr.read()).group(1)
    except (OSError, AttributeError):
        f["os"] = "unknown"
    f["kernel"] = os.uname().release
    f["glibc"] = first(["ldd", "--version"])
    f["cpu"] = first(["grep", "-m1", "model name", "/proc/cpuinfo"]).split(":", 1)[-1].strip()
    f["cores"] = os.cpu_count()
    f["compiler"] = first(["c++", "--version"])
    f["cmake"] = first(["cmake", "--version"])
    f["ninja"] = first(["ninja", "--version"])
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    f["nvcc"] = first([nvcc, "--version"], "release") if nvcc else "absent"
    f["compute_sanitizer"] = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), "absent")
    rc, gpu = capture(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    f["gpu"] = gpu.splitlines()[0] if rc == 0 and gpu else "none (%s)" % (
        "nvidia-smi absent" if rc is None else gpu.splitlines()[0] if gpu else "no GPU listed")
    py = ctx.torch_python()
    ctx.torch = ctx.torch_facts(py) if py else {"error": "no python3 with torch"}
    f["torch"] = ("%s (CUDA %s, %s)" % (ctx.torch["version"], ctx.torch["cuda"],
                  "GPU: %s" % ctx.torch["device"] if ctx.torch["cuda_available"] else "no GPU seen")
                  if "version" in ctx.torch else ctx.torch["error"])
    f["torch_python"] = py or "absent"
    f["torch_lib_dirs"] = ctx.torch.get("lib_dirs", [])
    ctx.rep.data["facts"] = f
    libs = [os.path.join(ctx.prefix, "usr", "lib", "x86_64-linux-gnu")] + f["torch_lib_dirs"]
    ctx.env = {"LD_LIBRARY_PATH": ":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(":"),
               # The reference files of this checkout, not the path compiled into prepared binaries.
               "PATRICKSTAR_TEST_DATA": os.path.join(ctx.root, "tests", "data")}
    if not ctx.dry_run and (rc != 0 or not gpu) and not ctx.torch.get("cuda_available"):
        ctx.no_gpu = True
        ctx.rep.data["no_gpu"] = True
        return "passed", "no NVIDIA GPU here: nothing will run on a GPU", {}, None
    return "passed", "%s; %s; torch %s" % (f["gpu"], f["compiler"], f["torch"]), {}, None


def capture(argv, timeout=60, cwd=None):
    """(exit status, output) of a short command; (None, reason) when it cannot run."""
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, cwd=cwd, check=False, errors="replace")
        return done.returncode, done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)


def load_check(ctx, paths):
    """Each prebuilt binary starts here with every symbol bound (a torch of another version fails)."""
    quick = {"ps_bench": ["--list-models"], "ps_micro": ["--benchmark_list_tests"], "ps_copy_bench": ["--device", "emulated", "--chunk-bytes",
             "4KiB", "--chunks", "1", "--rounds", "1"]}
    for target, path in paths.items():
        rc = ctx.command("load-" + target, [path] + quick.get(target, ["--gtest_list_tests"]),
                         env={"LD_BIND_NOW": "1"}, timeout=60)
        if rc != 0:
            return "%s does not start here (exit %s)" % (target, rc)
    return None


def binaries(ctx):
    why = None
    if not ctx.dry_run:
        why = prebuilt_reason(ctx)
        if why is None:
            paths = {t: os.path.join(ctx.prebuilt, t) for t in TARGETS}
            why = load_check(ctx, paths)
            if why is None:
                ctx.bins = paths
                return "passed", "prebuilt binaries from .gpu-deps/bin load here", {"source": "prebuilt"}, None
        ctx.say("prebuilt binaries not used: %s; building" % why)
    if not os.path.exists(os.path.join(ctx.build, "CMakeCache.txt")):
        if "cmake_dir" not in ctx.torch:
            return "failed", "no torch to build against: %s" % ctx.torch.get("error"), {}, None
        rc, out = ctx.configure(ctx.build, ctx.torch["cmake_dir"], "AUTO" if ctx.dry_run else "ON",
                                ctx.log_path("configure.log"), max(30, ctx.step_ends - time.time()))
        if rc != 0:
            return "failed", "configure: %s" % out.strip().splitlines()[-1] if out.strip() else "configure", {}, None
    jobs = str(ctx.jobs or os.cpu_count() or 2)
    rc = ctx.command("build", ["cmake", "--build", ctx.build, "-j", jobs, "--target"] + TARGETS)
    log = os.path.join(ctx.logs, "binaries-build.log")
    with open(log, errors="replace") as f:
        warnings = sum(1 for line in f if "warning:" in line)
    figures = {"source": "built", "warnings": warnings}
    if why:
        figures["prebuilt_not_used"] = why
    status, detail = outcome(rc, "the build")
    if status == "passed":
        ctx.bins = {t: os.path.join(ctx.build, rel) for t, rel in TARGET_PATHS.items()}
        detail = "built %s (%d compiler warnings, not fatal here)" % (", ".join(TARGETS), warnings)
    return status, detail, figures, None


def prebuilt_reason(ctx):
    stamp = os.path.join(ctx.prebuilt, "stamp.json")
    if not os.path.exists(stamp):
        return "no .gpu-deps/bin (scripts/gpu-check --prepare builds them)"
    with open(stamp) as f:
        s = json.load(f)
    if s.get("torch") != ctx.torch.get("version"):
        return "built against torch %s, this machine has %s" % (s.get("torch"), ctx.torch.get("version"))
    if s.get("sources") != ctx.sources_digest():
        return "built from other sources (digest %s, these are %s)" % (s.get("sources"), ctx.sources_digest())
    return None


# ---------------------------------------------------------------------------------------------
# the measurements and the suites

def device_env(ctx):
    return {"PATRICKSTAR_TEST_DEVICE": "emulated" if ctx.dry_run else "cuda"}


def read_figures(path, keys):
    """{key: value} from a JSON file; a.b reads a nested key. Raises ValueError naming what is absent."""
    with open(path) as f:
        d = json.load(f)
    figures = {}
    for key in keys:
        v = d
        for part in key.split("."):
            if not isinstance(v, dict) or part not in v:
                raise ValueError("%s has no %s" % (os.path.basename(path), key))
            v = v[part]
        figures[key] = v
    return figures


def copy_bandwidth(ctx):
    size = ["--chunk-bytes", "4MiB", "--chunks", "4", "--rounds", "2"] if ctx.dry_run else \
           ["--chunk-bytes", "64MiB", "--chunks", "8", "--rounds", "5"]
    out = ctx.log_path("copy_bandwidth.json")
    rc = ctx.command("ps_copy_bench", [ctx.bins["ps_copy_bench"], "--device",
                                       "emulated" if ctx.dry_run else "cuda"] + size + ["--json", out])
    if rc == 3:
        return "failed", "ps_copy_bench measured nothing (it sees no GPU)", {}, None
    status, detail = outcome(rc, "ps_copy_bench")
    if status != "passed":
        return status, detail, {}, None
    keys = ["round_trip_identical"] + ["%s.%s" % (d, k) for d in ("h2d", "d2h")
                                       for k in ("reference_gbps", "waited_ratio", "queued_ratio")]
    figures = read_figures(out, keys)
    if figures["round_trip_identical"] is not True:
        return "failed", "the bytes changed on the round trip", figures, None
    return "passed", "; ".join("%s: plain copy %.1f GB/s, waited %.2fx, queued %.2fx" % (
        d, figures[d + ".reference_gbps"], figures[d + ".waited_ratio"], figures[d + ".queued_ratio"])
        for d in ("h2d", "d2h")), figures, None


def parse_gtest(path):
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": []}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        counts["xml"] = "absent or unreadable (the binary died before writing it)"
        return counts
    for case in root.iter("testcase"):
        name = "%s.%s" % (case.get("classname"), case.get("name"))
        failure = case.find("failure")
        if failure is not None:
            counts["failed"] += 1
            message = (failure.get("message") or "").strip().splitlines()
            counts["failures"].append(name + (": " + message[0][:300] if message else ""))
        elif case.get("result") == "skipped" or case.find("skipped") is not None:
            counts["skipped"] += 1
            if len(counts["skips"]) < 5:
                skipped = case.find("skipped")
                counts["skips"].append(name + (": " + (skipped.get("message") or "")[:200]
                                               if skipped is not None else ""))
        elif case.get("status", "run") == "run":
            counts["passed"] += 1
    return counts


def gtest_runs(ctx, runs, must_run):
    """runs: [(label, target, [args], env)]; one step's gtest executables, their XML parsed."""
    total = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": []}
    worst = ("passed", "")
    for label, target, args, env in runs:
        xml = ctx.log_path(label + ".xml")
        rc = ctx.command(label, [ctx.bins[target], "--gtest_output=xml:" + xml] + args, env=env)
        counts = parse_gtest(xml)
        for key in ("passed", "failed", "skipped"):
            total[key] += counts[key]
        total["failures"] += counts["failures"]
        total["skips"] += counts["skips"]
        status, detail = outcome(rc, label)
        if status != "passed" and worst[0] == "passed":
            worst = (status, detail)
    status, detail = worst
    if status == "passed" and total["failed"]:
        status, detail = "failed", "%d tests failed" % total["failed"]
    if status == "passed" and must_run and total["passed"] == 0:
        status, detail = "failed", "no test ran (every one skipped: see the skips)"
    summary = "%d passed, %d failed, %d skipped" % (total["passed"], total["failed"], total["skipped"])
    return status, summary + ("; " + detail if detail else ""), {}, total


def cuda_filter(ctx, target):
    with open(os.path.join(ctx.root, "tests", "cuda_suites.txt")) as f:
        for line in f:
            if line.startswith(target + " "):
                return line.split(" ", 1)[1].strip()
    raise ValueError("tests/cuda_suites.txt has no line for " + target)


def cuda_engine_tests(ctx):
    # Two invocations: the suites proven on a GPU, then those never run on one, so that a crash in a
    # new suite leaves the proven ones' results (tests/cuda_suites.txt).
    return gtest_runs(ctx, [
        ("engine_tests", "engine_tests", ["--gtest_filter=" + cuda_filter(ctx, "engine_tests")],
         device_env(ctx)),
        ("engine_tests_new", "engine_tests", ["--gtest_filter=" + cuda_filter(ctx, "engine_tests_new")],
         device_env(ctx))], must_run=True)


def memtracer_cuda(ctx):
    return gtest_runs(ctx, [("memtracer_tests", "memtracer_tests",
                             ["--gtest_filter=" + cuda_filter(ctx, "memtracer_tests")], device_env(ctx))],
                      must_run=True)


def gpu_present_units(ctx):
    """What behaves differently where a GPU is present though it trains on the emulated device:
    pinning, the CUDA probe, CUDA's refusal and capacity paths, the copy queue."""
    plain = {"PATRICKSTAR_TEST_DEVICE": "emulated"}
    return gtest_runs(ctx, [
        ("chunk_tests", "chunk_tests", [], plain),
        ("optimizer_tests", "optimizer_tests", [], plain),
        ("memtracer_tests", "memtracer_tests", [], plain),
        ("engine_tests", "engine_tests", ["--gtest_filter=EmulatedDevice.*:CudaDevice.*:DeviceCapacity.*"],
         plain)], must_run=True)


def torchrun_gtest(ctx, label, target, ranks, args, env):
    """ranks processes of a gtest binary under torchrun (the torch wheel's; --no-python), each
    writing its own XML report; (exit status, rank 0's counts, the failures of every rank)."""
    xml = ctx.log_path(label + ".xml")
    argv = [ctx.torch_python(), "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(ranks), "--no-python", "sh", "-c",
            'exec "$0" --gtest_output=xml:"$PS_XML.$RANK" "$@"', ctx.bins[target]] + args
    rc = ctx.command(label, argv, env=dict(env, PS_XML=xml))
    counts = [parse_gtest("%s.%d" % (xml, r)) for r in range(ranks)]
    for r in range(ranks):
        ctx.rep.add_log(ctx.current, "%s-%s.xml.%d" % (ctx.current, label, r))
    failures = [f for c in counts for f in c["failures"]]
    return rc, counts[0], failures


def data_parallel_gpu(ctx):
    """Two ranks sharing the GPU through the store backend (Open MPI is absent there; NCCL takes one
    GPU per rank) train as one process does (tests/cuda_suites.txt's distributed_tests line), with
    the collective bytes and time they print; then NCCL itself, a world of one, every collective
    and a split on the GPU (comm_tests' NcclCommunicator)."""
    env = dict(device_env(ctx), PATRICKSTAR_COMM_BACKEND="store", OMP_NUM_THREADS="1",
               PATRICKSTAR_COMM_TIMEOUT_S="120")
    rc, counts, failures = torchrun_gtest(ctx, "two_ranks", "distributed_tests", 2,
                                          ["--gtest_filter=" + cuda_filter(ctx, "distributed_tests")],
                                          env)
    status, detail = outcome(rc, "2 ranks on one GPU")
    summary = "2 ranks: %d passed, %d failed, %d skipped" % (counts["passed"], len(failures),
                                                           counts["skipped"])
    if status == "passed" and (failures or counts["passed"] == 0):
        status, detail = "failed", "; ".join(failures[:3]) or "no test ran"
    nccl_env = {"PATRICKSTAR_TEST_NCCL": "0" if ctx.dry_run else "1"}
    nccl = gtest_runs(ctx, [("nccl_world_of_one", "comm_tests", ["--gtest_filter=NcclCommunicator.*"],
                             nccl_env)], must_run=not ctx.dry_run)
    if status == "passed" and nccl[0] != "passed":
        status, detail = nccl[0], nccl[1]
    return status, summary + "; NCCL: " + nccl[1] + ("; " + detail if detail else ""), {}, counts


# GPT2small (757M parameters, 128 positions) on an 80 GB GPU: bf16 under a 4 GiB cap, where its model
# data (10.6 GB) cannot stay on the device and chunks move every iteration, with the H100 prediction
# for the trace it records beside the measurement; fp32 under a 32 GiB cap, where it fits, against
# plain LibTorch on the same GPU (--baseline); and the default capacity ("auto": what GPU 0 has).
BENCHES = {
    "ps_bench_capped": (
        ["--model", "GPT2small", "--dtype", "bf16", "--batch", "8", "--device", "cuda:4GiB",
         "--steps", "5", "--predict", "h100"],
        ["--model", "gpt_mini", "--dtype", "bf16", "--batch", "2", "--device", "emulated:24MiB",
         "--steps", "3", "--predict", "h100"],
        ["step_time_s", "prediction.step_s", "prediction.exposed_copy_s",
         "prediction.schedules.overlapped_step_s", "prediction.schedules.delayed_step_s",
         "traffic_to_opt_bound", "h2d_bytes_per_iter", "copy_wait_s_per_iter", "device_peak_bytes",
         "device_capacity_bytes"]),
    "ps_bench_fits": (
        ["--model", "GPT2small", "--dtype", "fp32", "--batch", "8", "--device", "cuda:32GiB",
         "--steps", "5", "--baseline", "--predict", "h100"],
        ["--model", "gpt_mini", "--dtype", "fp32", "--batch", "2", "--device", "emulated:1GiB",
         "--steps", "3", "--baseline", "--predict", "h100"],
        ["step_time_ratio_to_baseline", "max_relative_loss_difference", "step_time_s",
         "prediction.step_s", "h2d_bytes_per_iter", "breakdown.engine_host_s",
         "breakdown.engine_entries", "breakdown.host_syncs"]),
    "ps_bench_auto": (
        ["--model", "gpt_mini", "--device", "cuda", "--steps", "3"],
        ["--model", "gpt_mini", "--steps", "3"],  # no --device: the emulated device's "auto"
        ["device_capacity_bytes", "step_time_s"]),
}
FP32_LOSS_TOLERANCE = 1e-3  # fp32 through the engine against plain LibTorch, same GPU


def ps_bench(ctx):
    gpu_args, dry_args, keys = BENCHES[ctx.current]
    bench = ctx.bins["ps_bench"]
    if ctx.dry_run:  # the GPU's exact command line, against the zoo and the config
        rc = ctx.command("check-flags", [bench] + gpu_args + ["--check-flags"], timeout=60)
        if rc != 0:
            return "failed", "the GPU command line is refused (exit %s): %s" % (
                rc, " ".join(gpu_args)), {}, None
    out = ctx.log_path("figures.json")
    rc = ctx.command("ps_bench", [bench] + (dry_args if ctx.dry_run else gpu_args) + ["--json", out])
    status, detail = outcome(rc, "ps_bench")
    if status != "passed":
        return status, detail, {}, None
    figures = read_figures(out, keys)
    if ctx.current == "ps_bench_capped" and not figures["h2d_bytes_per_iter"] > 0:
        return "failed", "no chunk moved: the cap did not bind", figures, None
    if ctx.current == "ps_bench_fits" and not figures["max_relative_loss_difference"] <= FP32_LOSS_TOLERANCE:
        return "failed", "losses differ from plain LibTorch by %g (> %g)" % (
            figures["max_relative_loss_difference"], FP32_LOSS_TOLERANCE), figures, None
    return "passed", ", ".join("%s %s" % (k, v if not isinstance(v, float) else "%.4g" % v)
                               for k, v in figures.items()), figures, None


def compute_sanitizer(ctx):
    tests = ctx.bins["engine_tests"]
    if ctx.dry_run:  # the filter must name one test
        listing = ctx.log_path("list.log")
        with open(listing, "w") as f:
            rc = subprocess.run([tests, "--gtest_list_tests", "--gtest_filter=" + SANITIZED_TEST],
                                stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, **ctx.env),
                                check=False, timeout=60).returncode
        with open(listing) as f:
            names = [l for l in f if l.startswith("  ")]
        if rc != 0 or len(names) != 1:
            return "failed", "%s matches %d tests" % (SANITIZED_TEST, len(names)), {}, None
        return "skipped", "dry run: no GPU for compute-sanitizer; its filter names 1 test", {}, None
    sanitizer = ctx.rep.data["facts"].get("compute_sanitizer", "absent")
    if sanitizer == "absent":
        return "skipped", "compute-sanitizer is not on this machine", {}, None
    return sanitize(ctx, sanitizer, tests)


def unsupported_device_line(log):
    """compute-sanitizer's own "device not supported" line in its log, or None."""
    try:
        with open(log, errors="replace") as f:
            for line in f:
                if "device not supported" in line.lower() or "unsupported device" in line.lower():
                    return line.strip().lstrip("=").strip()[:200]
    except OSError:
        pass
    return None


def sanitize(ctx, sanitizer, tests):
    xml = ctx.log_path("memcheck.xml")
    rc = ctx.command("memcheck", [sanitizer, "--tool", "memcheck", "--error-exitcode", "97", tests,
                                  "--gtest_filter=" + SANITIZED_TEST, "--gtest_output=xml:" + xml],
                     env=device_env(ctx))
    counts = parse_gtest(xml)
    unsupported = unsupported_device_line(os.path.join(ctx.logs, "%s-memcheck.log" % ctx.current))
    if unsupported:  # an older compute-sanitizer than the GPU: nothing was checked, nothing failed
        return "skipped", "compute-sanitizer cannot check this GPU: " + unsupported, {}, counts
    if rc == 97:
        return "failed", "compute-sanitizer memcheck reported errors in " + SANITIZED_TEST, {}, counts
    status, detail = outcome(rc, "compute-sanitizer")
    if status == "passed" and counts["passed"] != 1:
        status, detail = "failed", "the test did not run under compute-sanitizer"
    return status, detail or "memcheck clean on " + SANITIZED_TEST, {}, counts


import gpu_check_perf as perf  # noqa: E402  (its steps use this module's helpers)

# The last five do not fit the default deadline with the others; each runs in a window of its own:
# scripts/gpu-check --only <step> --deadline 590 (README).
STEPS = [
    Step("facts", facts, 120, 10, always=True),
    Step("binaries", binaries, 420, 30),
    Step("copy_bandwidth", copy_bandwidth, 60, 15),
    Step("cuda_engine_tests", cuda_engine_tests, 200, 30),
    Step("memtracer_cuda", memtracer_cuda, 60, 15),
    Step("gpu_present_units", gpu_present_units, 120, 20),
    Step("data_parallel_gpu", data_parallel_gpu, 180, 40),
    Step("ps_bench_capped", ps_bench, 120, 40),
    Step("ps_bench_fits", ps_bench, 150, 60),
    Step("ps_bench_auto", ps_bench, 60, 20),
    Step("device_adam", perf.device_adam, 90, 30),
    Step("compute_sanitizer", compute_sanitizer, 150, 40),
    Step("host_adam_hidden", perf.host_adam_hidden, 300, 120),
    Step("plan_compare", perf.plan_compare, 500, 150),
    Step("large_model_24g", perf.large_model_24g, 580, 300),
    Step("large_model_40g", perf.large_model_40g, 580, 300),
    Step("largest_gpt", perf.largest_gpt, 300, 200),
]
