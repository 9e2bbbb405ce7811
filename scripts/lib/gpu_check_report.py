"""gpu-check's report: gpu-check.json, gpu-check.md and gpu-check-logs.tar.gz in the report folder,
rewritten whole after every step and on exit (each file replaced by a rename, so a reader never sees
half of one), and the checker that scripts/test runs on a dry run's report."""
import json
import os
import platform
import tarfile
import time

FILES = ("gpu-check.json", "gpu-check.md", "gpu-check-logs.tar.gz")
MAX_FILES = 8  # what the lent GPU machine brings back from $OUT
STATUSES = ("pending", "running", "passed", "failed", "timed_out", "interrupted", "skipped")
TAIL_LINES = 25


class Report:
    def __init__(self, out, logs, dry_run, deadline):
        self.out, self.logs = out, logs
        self.started = time.time()
        self.log_names = {}  # step: the logs its commands write (listed once they exist)
        self.data = {
            "status": "running", "mode": "dry-run (emulated device)" if dry_run else "gpu",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "deadline_s": deadline, "elapsed_s": 0.0, "host": platform.node(), "facts": {},
            "steps": [],
        }
        for name in FILES:  # an earlier run's report must not pass for this one
            path = os.path.join(out, name)
            if os.path.exists(path):
                os.remove(path)

    def plan(self, names):
        self.data["steps"] = [{"step": n, "status": "pending", "seconds": 0.0, "detail": "",
                               "figures": {}, "logs": []} for n in names]

    def step(self, name):
        for s in self.data["steps"]:
            if s["step"] == name:
                return s
        raise KeyError(name)

    def start(self, name):
        s = self.step(name)
        s["status"], s["started_s"] = "running", round(time.time() - self.started, 1)
        self.write()

    def finish(self, name, status, detail, figures=None, tests=None, deadline=False):
        assert status in STATUSES, status
        s = self.step(name)
        s["status"], s["detail"] = status, detail
        if "started_s" in s:
            s["seconds"] = round(time.time() - self.started - s["started_s"], 1)
        if figures:
            s["figures"].update(figures)
        if tests is not None:
            s["tests"] = tests
        if deadline:
            s["skipped_for_deadline"] = True
        self.write()

    def add_log(self, name, log):
        self.log_names.setdefault(name, []).append(os.path.basename(log))

    def interrupt(self, current, why):
        for s in self.data["steps"]:
            if s["status"] == "running" or s["step"] == current and s["status"] == "pending":
                s["status"], s["detail"] = "interrupted", why
            elif s["status"] == "pending":
                s["status"], s["detail"] = "skipped", "not reached: " + why
        self.data["interrupted"] = why

    def overall(self):
        statuses = [s["status"] for s in self.data["steps"]]
        if self.data.get("no_gpu"):
            return "no_gpu"
        if any(st in ("failed", "timed_out", "interrupted") for st in statuses):
            return "failed"
        if any(s.get("skipped_for_deadline") for s in self.data["steps"]) or \
                any(st in ("pending", "running") for st in statuses):
            return "incomplete"
        return "passed"

    def exit_status(self):
        return {"passed": 0, "failed": 1, "incomplete": 2, "no_gpu": 3}[self.overall()]

    def files(self):
        return sorted(f for f in os.listdir(self.out) if os.path.isfile(os.path.join(self.out, f)))

    def write(self, final=False):
        self.data["elapsed_s"] = round(time.time() - self.started, 1)
        for s in self.data["steps"]:
            s["logs"] = [log for log in self.log_names.get(s["step"], [])
                         if os.path.exists(os.path.join(self.logs, log))]
        self.data["status"] = self.overall() if final or "interrupted" in self.data else "running"
        replace(os.path.join(self.out, FILES[0]), json.dumps(self.data, indent=1) + "\n")
        replace(os.path.join(self.out, FILES[1]), markdown(self.data))
        archive = os.path.join(self.out, FILES[2])
        with tarfile.open(archive + ".part", "w:gz") as tar:
            for name in sorted(os.listdir(self.logs)):
                tar.add(os.path.join(self.logs, name), arcname="gpu-check-logs/" + name)
        os.replace(archive + ".part", archive)


def replace(path, text):
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)


def cell(text):
    return str(text).replace("|", "/").replace("\n", " ")


def markdown(d):
    lines = ["# gpu-check, %s" % d["date"], "",
             "Mode: %s. Status: **%s** after %.0f s of a %.0f s deadline." %
             (d["mode"], d["status"], d["elapsed_s"], d["deadline_s"]), ""]
    if d.get("interrupted"):
        lines += ["Interrupted: %s." % d["interrupted"], ""]
    if d["facts"]:
        lines += ["| fact | value |", "| --- | --- |"]
        lines += ["| %s | %s |" % (k, cell(v)) for k, v in d["facts"].items() if k != "torch_lib_dirs"]
        lines.append("")
    lines += ["| step | status | seconds | detail |", "| --- | --- | --- | --- |"]
    for s in d["steps"]:
        lines.append("| %s | %s | %.1f | %s |" % (s["step"], s["status"], s["seconds"], cell(s["detail"])))
    for s in d["steps"]:
        extra = []
        if s["figures"]:
            extra.append("figures: " + ", ".join("%s %s" % (k, v) for k, v in s["figures"].items()))
        for failure in (s.get("tests") or {}).get("failures", []):
            extra.append("failed: " + failure)
        if extra:
            lines += ["", "### %s" % s["step"], ""] + ["- " + cell(e) for e in extra]
    lines += ["", "Logs: gpu-check-logs.tar.gz (one log per command, gtest XML beside them)."]
    return "\n".join(lines) + "\n"


def verify(folder, expects):
    """0 when folder holds a complete report (every step settled, both texts readable, the logs of
    every step that ran in the archive, at most MAX_FILES files); expects: ["step=status", ...]."""
    problems = []
    files = [os.path.join(b, f) for b, _, fs in os.walk(folder) for f in fs]
    if len(files) > MAX_FILES:
        problems.append("%d files under %s (at most %d come back)" % (len(files), folder, MAX_FILES))
    try:
        with open(os.path.join(folder, FILES[0])) as f:
            d = json.load(f)
        with open(os.path.join(folder, FILES[1])) as f:
            md = f.read()
        with tarfile.open(os.path.join(folder, FILES[2])) as tar:
            archived = {os.path.basename(n) for n in tar.getnames()}
    except (OSError, ValueError, tarfile.TarError) as e:
        print("gpu-check report: FAILED: %s" % e)
        return 1
    if d.get("status") not in ("passed", "failed", "incomplete", "no_gpu"):
        problems.append("overall status %r is not final" % d.get("status"))
    if not d.get("facts"):
        problems.append("no facts")
    for s in d.get("steps", []):
        if s.get("status") not in STATUSES[2:]:
            problems.append("step %s: status %r is not final" % (s.get("step"), s.get("status")))
        if s.get("step") not in md:
            problems.append("step %s is not in gpu-check.md" % s.get("step"))
        if s.get("status") not in ("skipped",) and not s.get("logs") and s.get("step") != "facts":
            problems.append("step %s ran but has no log" % s.get("step"))
        missing = [log for log in s.get("logs", []) if log not in archived]
        if missing:
            problems.append("step %s: logs missing from the archive: %s" % (s.get("step"), missing))
    by_name = {s.get("step"): s for s in d.get("steps", [])}
    for expect in expects:
        name, _, status = expect.partition("=")
        got = by_name.get(name, {}).get("status")
        if got != status:
            problems.append("step %s is %r, expected %r" % (name, got, status))
    for p in problems:
        print("gpu-check report: FAILED: " + p)
    if not problems:
        print("gpu-check report: complete (%s, %d steps, %d files, status %s)" %
              (folder, len(d.get("steps", [])), len(files), d["status"]))
    return 1 if problems else 0
