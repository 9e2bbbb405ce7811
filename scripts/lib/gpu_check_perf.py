"""gpu-check's speed and scale steps (issue 57): the device Adam against ATen's fused AdamW and a copy
of the same bytes (ps_micro), and the largest batch of Llama 3 8B's shape and the largest GPT that
train with the device capped at a consumer GPU's memory (ps_bench). On the emulated device with
--dry-run: the same binaries on small sizes, and the GPU command lines checked with --check-flags."""
import json
import time

import gpu_check_steps as steps

ADAM_GOAL_VS_FUSED = 1.0  # the device Adam's time at most fused AdamW's
ADAM_GOAL_OF_COPY = 0.8   # and at least 0.8 of a device-to-device copy's bytes per second


def device_adam(ctx):
    """ps_micro's BM_DeviceAdam: fp32, mixed, bf16 states, each interleaved with _fused_adamw_ and a
    copy. The goals are reported beside the figures; missing them is a finding, not a failure."""
    out = ctx.log_path("device_adam.json")
    env = {"PATRICKSTAR_BENCH_DEVICE": "cpu" if ctx.dry_run else "cuda",
           "PATRICKSTAR_BENCH_PARAMS": str(1 << 20 if ctx.dry_run else 1 << 26)}
    rc = ctx.command("ps_micro", [ctx.bins["ps_micro"], "--benchmark_filter=BM_DeviceAdam",
                                  "--benchmark_min_time=%s" % ("0.05" if ctx.dry_run else "1"),
                                  "--benchmark_out=" + out, "--benchmark_out_format=json"], env=env)
    status, detail = steps.outcome(rc, "ps_micro")
    if status != "passed":
        return status, detail, {}, None
    with open(out) as f:
        runs = json.load(f).get("benchmarks", [])
    figures = {}
    for run in runs:
        if run.get("error_occurred"):
            return "failed", "%s: %s" % (run["name"], run.get("error_message")), figures, None
        variant = run["name"].split("/")[1]
        figures[variant] = {k: run[k] for k in ("vs_fused", "of_copy", "adam_GBps", "fused_GBps",
                                                "copy_GBps", "params") if k in run}
    if len(figures) != 4:
        return "failed", "ps_micro ran %d of the 4 device Adam variants" % len(figures), figures, None
    met = all(v["vs_fused"] >= ADAM_GOAL_VS_FUSED and v["of_copy"] >= ADAM_GOAL_OF_COPY
              for v in figures.values())
    return "passed", "%s; goals (>= %.1fx fused, >= %.1f of the copy) %s" % (
        "; ".join("%s %.2fx fused, %.2f of the copy, %.0f GB/s" % (
            name, v["vs_fused"], v["of_copy"], v["adam_GBps"]) for name, v in figures.items()),
        ADAM_GOAL_VS_FUSED, ADAM_GOAL_OF_COPY, "met" if met else "NOT met"), figures, None


# Llama 3 8B's shape with deferred initialization (no rank ever holds it whole in fp32), bf16 with
# bf16 optimizer states, at 1,024 tokens per sequence, each block's activations recomputed in
# backward (PatrickStar's large-model runs checkpointed activations too), the device capped at 24 GiB
# (a consumer GPU) and at 40 GiB: one step each (large_model_24g, large_model_40g), so each has a
# window of its own. Batches double from 1 until one does not train or the window ends; every trial
# builds the 8B model again (deferred initialization fills 80 GB of host chunks), so a window holds
# a few. The largest GPT at 24 GiB: ps_bench --find-max-model over the layers of GPT3_8B's width.
LARGE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
SEQ, DRY_SEQ = 1024, 64  # llama_mini has 64 positions
LARGE_KEYS = ["step_time_s", "samples_per_s", "tflops_megatron", "device_peak_bytes",
              "host_peak_bytes", "params"]


def bf16_states_config(ctx):
    """A config with Llama's betas (0.9, 0.95): bf16 states are refused with beta2 0.999."""
    path = ctx.log_path("bf16_states_config.json")
    with open(path, "w") as f:
        json.dump({"optimizer": {"type": "AdamW", "params": {
            "lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "state_dtype": "bf16"}}}, f)
    return path


def large_args(config, model, cap, batch, dry_run):
    device = ("emulated:%s" % ("48MiB" if cap == "24GiB" else "80MiB")) if dry_run else "cuda:" + cap
    return ["--model", model, "--config", config, "--deferred-init", "--dtype", "bf16",
            "--batch", str(batch), "--seq", str(DRY_SEQ if dry_run else SEQ), "--device", device,
            "--checkpoint-activations", "--steps", "3", "--predict", "h100"]


def largest_batch(ctx, cap, config):
    """The largest batch of LARGE_BATCHES that trains at `cap`, with its figures (None if none)."""
    best = None
    for batch in LARGE_BATCHES:
        if ctx.step_ends - time.time() < 30:  # no room left for another trial
            break
        if ctx.dry_run:
            rc = ctx.command("check-flags-%s-b%d" % (cap, batch),
                             [ctx.bins["ps_bench"]] + large_args(config, "llama_8B", cap, batch, False) +
                             ["--check-flags"], timeout=60)
            if rc != 0:
                raise ValueError("the GPU command line is refused (exit %s)" % rc)
        out = ctx.log_path("llama_8B-%s-b%d.json" % (cap, batch))
        model = "llama_mini" if ctx.dry_run else "llama_8B"
        rc = ctx.command("ps_bench-%s-b%d" % (cap, batch), [ctx.bins["ps_bench"]] +
                         large_args(config, model, cap, batch, ctx.dry_run) + ["--json", out])
        if rc != 0:
            break
        figures = steps.read_figures(out, LARGE_KEYS + ["prediction.step_s"])
        figures["batch"] = batch
        figures["tokens_per_s"] = figures["samples_per_s"] * (DRY_SEQ if ctx.dry_run else SEQ)
        figures["measured_over_predicted"] = figures["step_time_s"] / figures["prediction.step_s"]
        best = figures
        if ctx.dry_run and batch >= 2:  # the dry run proves the loop, not the device's limit
            break
    return best


def large_model(ctx, cap):
    try:
        best = largest_batch(ctx, cap, bf16_states_config(ctx))
    except ValueError as e:
        return "failed", str(e), {}, None
    if best is None:
        return "failed", "llama_8B trained at no batch with the device at %s" % cap, {}, None
    f = best
    return "passed", (
        "%s: batch %d, %.0f tokens/s, %.1f TFLOPs, device peak %.1f GiB, host peak %.1f GiB, "
        "measured/predicted %.2f" % (cap, f["batch"], f["tokens_per_s"], f["tflops_megatron"],
                                     f["device_peak_bytes"] / 2**30, f["host_peak_bytes"] / 2**30,
                                     f["measured_over_predicted"])), {cap: f}, None


def large_model_24g(ctx):
    return large_model(ctx, "24GiB")


def large_model_40g(ctx):
    return large_model(ctx, "40GiB")


def largest_gpt(ctx):
    out = ctx.log_path("find_max_model.json")
    device = "emulated:64MiB" if ctx.dry_run else "cuda:24GiB"
    model = "gpt_small_cpu" if ctx.dry_run else "GPT3_8B"
    rc = ctx.command("ps_bench", [ctx.bins["ps_bench"], "--find-max-model", "--model", model,
                                  "--config", bf16_states_config(ctx), "--device", device,
                                  "--dtype", "bf16", "--host-memory",
                                  "512MiB" if ctx.dry_run else "100GiB",
                                  "--batch", "1", "--search-steps", "2",
                                  "--max-layers", "16" if ctx.dry_run else "512", "--json", out])
    status, detail = steps.outcome(rc, "ps_bench --find-max-model")
    if status != "passed":
        return status, detail, {}, None
    with open(out) as f:
        figures = json.load(f)
    return "passed", "the largest GPT at %s: %s" % (device, json.dumps(figures)[:300]), figures, None


# Where the host Adam hides (issue 57, item 3): GPT2small bf16 at cuda:4GiB (its states do not fit:
# the host Adam runs), serial against overlapped (--compare-step) and delayed (--compare-delayed),
# at batch 8 and at the batch where the predicted GPU compute matches the host Adam (--predict
# names it), the prediction's three schedules beside each.
HIDDEN_GPU = ["--model", "GPT2small", "--dtype", "bf16", "--device", "cuda:4GiB"]
HIDDEN_DRY = ["--model", "gpt_mini", "--dtype", "bf16", "--device", "emulated:24MiB"]


def host_adam_hidden(ctx):
    base = HIDDEN_DRY if ctx.dry_run else HIDDEN_GPU
    first = 2 if ctx.dry_run else 8
    out = ctx.log_path("predict-b%d.json" % first)
    rc = ctx.command("predict-b%d" % first, [ctx.bins["ps_bench"]] + base + [
        "--batch", str(first), "--steps", "4", "--predict", "h100", "--json", out])
    status, detail = steps.outcome(rc, "ps_bench --predict")
    if status != "passed":
        return status, detail, {}, None
    with open(out) as f:
        prediction = json.load(f).get("prediction", {})
    batches = [first]
    matched = prediction.get("matched_batch", {}).get("batch")
    if matched and matched != first:
        batches.append(min(int(matched), 4 * first if ctx.dry_run else 64))
    figures = {"predicted_b%d" % first: prediction.get("schedules"),
               "matched_batch_predicted": prediction.get("matched_batch")}
    lines, failed = [], False
    for batch in batches:
        for mode, key in (("--compare-step", "overlapped_to_serial"),
                          ("--compare-delayed", "delayed_to_serial")):
            if ctx.step_ends - time.time() < 30:
                break
            out = ctx.log_path("%s-b%d.json" % (mode[2:], batch))
            rc = ctx.command("%s-b%d" % (mode[2:], batch), [ctx.bins["ps_bench"]] + base + [
                "--batch", str(batch), "--steps", "12" if ctx.dry_run else "13", mode, "--json", out])
            if rc != 0:
                lines.append("%s at batch %d: exit %s" % (mode, batch, rc))
                failed = True
                continue
            measured = steps.read_figures(out, [key, "serial_s"])
            figures["%s_b%d" % (mode[2:], batch)] = measured
            lines.append("batch %d %s %.2f" % (batch, key, measured[key]))
    return "failed" if failed else "passed", "; ".join(lines), figures, None


# The plan on a GPU (issue 61): GPT2small bf16 at cuda:4GiB ("plan": "auto", every candidate it
# considers trained pinned beside it, --compare-plan), at batch 8 and at the batch where --predict
# says GPU compute matches the host Adam. Reported: the plan's choice, its measured step over the
# best candidate's, measured over predicted, and whether it chose an overlapped step that measured
# slower than the serial one of the same size and placement.
def plan_compare(ctx):
    base = HIDDEN_DRY if ctx.dry_run else HIDDEN_GPU
    first = 2 if ctx.dry_run else 8
    batches = [first]
    out = ctx.log_path("plan-predict-b%d.json" % first)
    rc = ctx.command("plan-predict-b%d" % first, [ctx.bins["ps_bench"]] + base + [
        "--batch", str(first), "--steps", "4", "--predict", "h100", "--json", out])
    if rc == 0:
        with open(out) as f:
            matched = json.load(f).get("prediction", {}).get("matched_batch", {}).get("batch")
        if matched and matched != first:
            batches.append(min(int(matched), 4 * first if ctx.dry_run else 64))
    figures, lines, failed = {}, [], False
    for batch in batches:
        if ctx.step_ends - time.time() < 60:
            break
        out = ctx.log_path("compare-plan-b%d.json" % batch)
        rc = ctx.command("compare-plan-b%d" % batch, [ctx.bins["ps_bench"]] + base + [
            "--batch", str(batch), "--steps", "8" if ctx.dry_run else "20", "--compare-plan",
            "--json", out])
        if rc != 0:
            lines.append("batch %d: exit %s" % (batch, rc))
            failed = True
            continue
        with open(out) as f:
            j = json.load(f)
        chosen = j["plan"]["chosen"]
        measured = {c["name"]: c.get("measured_step_s", 0) for c in j["candidates"]}
        serial_twin = chosen.replace(", overlapped,", ", serial,")
        slower_overlap = (", overlapped," in chosen and serial_twin in measured
                          and measured.get(chosen, 0) > measured[serial_twin])
        figures["b%d" % batch] = {
            "chosen": chosen, "plan_to_best": j["plan_to_best"], "best": j["best_candidate"],
            "measured_over_predicted": [j["measured_over_predicted_min"],
                                        j["measured_over_predicted_max"]],
            "losses_equal": j["losses_equal"], "overlapped_chosen_where_slower": slower_overlap}
        failed = failed or not j["losses_equal"]
        lines.append("batch %d: chose %s, %.3fx the best (%s)%s" % (
            batch, chosen, j["plan_to_best"], j["best_candidate"],
            "; the overlapped step chosen where it measured slower" if slower_overlap else ""))
    return "failed" if failed else "passed", "; ".join(lines), figures, None
