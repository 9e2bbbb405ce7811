#!/usr/bin/env python3
"""scripts/gpu-check: the CUDA path on a machine with an NVIDIA GPU, in one window.

Steps run in order of value under one deadline; a step that no longer fits is skipped, each runs
under its own timeout, and the report (gpu-check.json, gpu-check.md, gpu-check-logs.tar.gz: three
files) is rewritten after every step and on any exit, so a hang, a kill or the window's end still
leaves what ran. --dry-run runs the same steps on the emulated device (scripts/test does)."""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check_report as report  # noqa: E402  (the report's files and their checker)
import gpu_check_steps as steps_mod  # noqa: E402  (what each step runs)
from gpu_check_steps import capture  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPS = os.path.join(ROOT, ".gpu-deps")
PREFIX = os.path.join(DEPS, "prefix")
PREBUILT = os.path.join(DEPS, "bin")
# What the build needs beyond CMake, Ninja, a compiler, CUDA and torch, with the shared libraries
# they link (Debian 12 names): unpacked, never installed (dpkg -x).
PACKAGES = ["nlohmann-json3-dev", "libabsl-dev", "libabsl20220623", "libhwy-dev", "libhwy1",
            "libgtest-dev", "libgmock-dev", "googletest", "libbenchmark-dev",
            "libbenchmark1debian"]


class Interrupted(BaseException):  # not an Exception: a step's own error handling lets it through
    """A signal (timeout's SIGTERM, Ctrl-C) arrived: the report is written and the run ends."""


def say(text):
    print("gpu-check: " + text, flush=True)


def die(text):
    print("gpu-check: FAILED: " + text, file=sys.stderr, flush=True)
    sys.exit(1)


def torch_python():
    """python3 when it imports torch (the GPU machines), else the project's .venv (here)."""
    for py in ("python3", os.path.join(ROOT, ".venv", "bin", "python")):
        rc, _ = capture([py, "-c", "import torch"], timeout=90)
        if rc == 0:
            return py
    return None


def torch_facts(py):
    code = ("import json, os, torch, torch.utils\n"
            "lib = os.path.join(os.path.dirname(torch.__file__), 'lib')\n"
            "site = os.path.dirname(os.path.dirname(torch.__file__))\n"
            "nv = os.path.join(site, 'nvidia')\n"
            "libs = [lib] + sorted(os.path.join(nv, d, 'lib') for d in (os.listdir(nv) if os.path.isdir(nv) else [])\n"
            "                      if os.path.isdir(os.path.join(nv, d, 'lib')))\n"
            "ok = torch.cuda.is_available()\n"
            "print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, 'cuda_available': ok,\n"
            "  'device': torch.cuda.get_device_name(0) if ok else None, 'lib_dirs': libs,\n"
            "  'cmake_dir': os.path.join(torch.utils.cmake_prefix_path, 'Torch')}))\n")
    rc, out = capture([py, "-c", code], timeout=90)
    if rc != 0:
        return {"error": out[-400:]}
    return json.loads(out.splitlines()[-1])


def sources_digest():
    """A digest of the sources the binaries are built from (the GPU machine gets no .git)."""
    import hashlib
    digest = hashlib.sha256()
    for folder in ("chunk", "comm", "optimizer", "memtracer", "engine", "patrickstar", "models", "benchmarks",
                   "tests", "cmake"):
        for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".cpp", ".h", ".cu", ".cuh", ".txt", ".cmake", ".in")):
                    path = os.path.join(base, name)
                    digest.update(os.path.relpath(path, ROOT).encode())
                    with open(path, "rb") as f:
                        digest.update(f.read())
    with open(os.path.join(ROOT, "CMakeLists.txt"), "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()[:16]


def configure(build, torch_dir, cuda="ON", log=None, timeout=600):
    """Configures the GPU build (Release, warnings counted but not fatal, no MPI, no examples)."""
    if not os.path.isdir(os.path.join(PREFIX, "usr")):
        return 1, ("no .gpu-deps/prefix: run scripts/gpu-check --prepare where a Debian mirror "
                   "is reachable, and carry .gpu-deps")
    os.makedirs(build, exist_ok=True)
    argv = ["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DPATRICKSTAR_CUDA=" + cuda, "-DPATRICKSTAR_MPI=OFF", "-DPATRICKSTAR_WERROR=OFF",
            "-DPATRICKSTAR_BUILD_EXAMPLES=OFF", "-DCMAKE_PREFIX_PATH=" + os.path.join(PREFIX, "usr"),
            "-DTorch_DIR=" + torch_dir]
    rc, out = capture(argv, timeout=timeout)
    if log:
        with open(log, "w") as f:
            f.write(" ".join(argv) + "\n" + out + "\n")
    return rc, out


def prepare(args):
    """Here, with a Debian mirror: the packages (unpacked) and the binaries the check runs."""
    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        die("--prepare needs apt-get and dpkg")
    if os.path.isdir(DEPS):
        shutil.rmtree(DEPS)
    debs = os.path.join(DEPS, "debs")
    os.makedirs(debs)
    os.makedirs(PREFIX)
    say("downloading %d Debian packages into .gpu-deps/debs" % len(PACKAGES))
    rc, out = capture(["apt-get", "download"] + PACKAGES, timeout=600, cwd=debs)
    if rc != 0:
        print(out[-2000:], file=sys.stderr)
        die("apt-get download (run apt-get update first; is the mirror reachable?)")
    for deb in sorted(os.listdir(debs)):
        rc, out = capture(["dpkg", "-x", os.path.join(debs, deb), PREFIX], timeout=300)
        if rc != 0:
            die("dpkg -x %s: %s" % (deb, out[-400:]))
    with open(os.path.join(DEPS, "packages.txt"), "w") as f:
        f.write("\n".join(sorted(os.listdir(debs))) + "\n")
    shutil.rmtree(debs)  # unpacked: the archives would only take room in the carried folder
    say("unpacked into .gpu-deps/prefix (%s)" % du(PREFIX))
    if args.no_binaries:
        return 0
    py = torch_python()
    if py is None:
        die("no python with torch (run scripts/setup)")
    torch = torch_facts(py)
    if "error" in torch:
        die("torch: " + torch["error"])
    build = args.build_dir or os.path.join(ROOT, "build-gpu")
    rc, out = configure(build, torch["cmake_dir"], "ON", os.path.join(DEPS, "configure.log"))
    if rc != 0:
        die("configure with CUDA (log: .gpu-deps/configure.log): " + out[-600:])
    digest = sources_digest()  # what the build starts from (edits during it do not count)
    jobs = str(args.jobs or os.cpu_count() or 2)
    say("building %s with CUDA in %s (%s jobs; about 12 minutes on 2 cores)"
        % (" ".join(steps_mod.TARGETS), build, jobs))
    start = time.time()
    with open(os.path.join(DEPS, "build.log"), "w") as log:
        proc = subprocess.run(["cmake", "--build", build, "-j", jobs, "--target"] + steps_mod.TARGETS,
                              stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        die("build (log: .gpu-deps/build.log)")
    os.makedirs(PREBUILT)
    for target, rel in steps_mod.TARGET_PATHS.items():
        dst = os.path.join(PREBUILT, target)
        shutil.copy2(os.path.join(build, rel), dst)
        capture(["strip", "--strip-unneeded", dst], timeout=300)
    stamp = {"torch": torch["version"], "torch_cuda": torch["cuda"], "sources": digest,
             "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(os.path.join(PREBUILT, "stamp.json"), "w") as f:
        json.dump(stamp, f, indent=1)
    say("built in %d s; binaries in .gpu-deps/bin (%s, torch %s); .gpu-deps is %s: carry it"
        % (time.time() - start, du(PREBUILT), torch["version"], du(DEPS)))
    return 0


def du(path):
    rc, out = capture(["du", "-sh", path])
    return out.split()[0] if rc == 0 and out else "?"


def configure_only(args):
    py = torch_python()
    if py is None:
        die("no python with torch (the GPU machines have python3 with torch; here run scripts/setup)")
    build = args.build_dir or os.path.join(ROOT, "build-gpu")
    rc, out = configure(build, torch_facts(py).get("cmake_dir", ""), "AUTO")
    if rc != 0:
        die("configure: " + out[-800:])
    say("configured %s; dependencies found at:" % build)
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        for line in f:
            if line.split("_DIR", 1)[0] in ("absl", "nlohmann_json", "hwy", "GTest", "benchmark", "Torch") \
                    and "_DIR:" in line:
                print("  " + line.strip())
    return 0


def main():
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="report folder (default: $OUT, else results/gpu-check)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="every step on the emulated device (no GPU needed); scripts/test runs it")
    mode.add_argument("--prepare", action="store_true",
                      help="here: unpack the Debian packages and build the binaries into .gpu-deps")
    mode.add_argument("--configure-only", action="store_true",
                      help="configure the GPU build against .gpu-deps (CUDA where nvcc is) and stop")
    mode.add_argument("--verify-report", metavar="DIR",
                      help="check a report folder (complete, parses, at most 8 files) and exit")
    parser.add_argument("--expect", action="append", default=[], metavar="STEP=STATUS",
                        help="with --verify-report: the status a step must have")
    parser.add_argument("--build-dir", help="build folder (default build-gpu; scripts/test: build)")
    parser.add_argument("--deadline", type=float, default=560,
                        help="seconds for the whole run, report included (default 560)")
    parser.add_argument("--only", help="comma-separated steps to run (facts and binaries always)")
    parser.add_argument("--stall", metavar="STEP",
                        help="testing: STEP's command hangs instead, to show its timeout")
    parser.add_argument("--stall-timeout", type=float, default=3,
                        help="testing: the stalled step's timeout in seconds (default 3)")
    parser.add_argument("--jobs", type=int, help="build jobs (default: the cores)")
    parser.add_argument("--no-binaries", action="store_true", help="with --prepare: packages only")
    args = parser.parse_args()

    if args.prepare:
        return prepare(args)
    if args.configure_only:
        return configure_only(args)
    if args.verify_report:
        return report.verify(args.verify_report, args.expect)
    out = args.out or os.environ.get("OUT") or os.path.join(ROOT, "results", "gpu-check")
    return run(args, os.path.abspath(out))


def run(args, out):
    started = time.time()
    os.makedirs(out, exist_ok=True)
    logs = tempfile.mkdtemp(prefix="gpu-check-logs-")
    rep = report.Report(out, logs, dry_run=args.dry_run, deadline=args.deadline)
    ctx = steps_mod.Context(root=ROOT, prefix=PREFIX, prebuilt=PREBUILT, logs=logs, rep=rep,
                            dry_run=args.dry_run, deadline_at=started + args.deadline,
                            build=args.build_dir or os.path.join(ROOT, "build-gpu"),
                            stall=args.stall, stall_timeout=args.stall_timeout, jobs=args.jobs,
                            torch_python=torch_python, torch_facts=torch_facts,
                            configure=configure, sources_digest=sources_digest, say=say)

    def on_signal(signum, _frame):
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # once: the report is written next
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signal.Signals(signum).name)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    selected = set(args.only.split(",")) if args.only else None
    if selected is not None:
        unknown = selected - {s.name for s in steps_mod.STEPS}
        if unknown:
            die("--only: unknown steps %s (known: %s)" % (", ".join(sorted(unknown)),
                ", ".join(s.name for s in steps_mod.STEPS)))
        selected.add("binaries")  # what the others run
    rep.plan([s.name for s in steps_mod.STEPS])
    rep.write()
    rc = 0
    try:
        for step in steps_mod.STEPS:
            if selected is not None and not step.always and step.name not in selected:
                rep.finish(step.name, "skipped", "not selected (--only)")
                continue
            ctx.run_step(step)
        rc = rep.exit_status()
    except Interrupted as e:
        ctx.kill_current()
        rep.interrupt(ctx.current, "interrupted by %s after %.0f s" % (e, time.time() - started))
        rc = 124
    finally:
        # The final report is written whole: a signal now (timeout's TERM as the window closes) is
        # ignored instead of cutting the write short.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        rep.write(final=True)
        say("%s in %.0f s; report: %s (%s)" % (rep.data["status"], time.time() - started, out,
                                               ", ".join(rep.files())))
    return rc


if __name__ == "__main__":
    sys.exit(main())
