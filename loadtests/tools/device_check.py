"""The GPU device check: the suite's GPU tests, then the decode throughput benchmark, in one
command that needs the project and torch for CUDA only (no Ray, nothing from service/). Writes one
JSON report (after each part: a run cut off keeps what it did) and prints one table.

    python loadtests/tools/device_check.py                   # on the GPU machine
    python loadtests/tools/device_check.py --dry-run         # the same sequence on the CPU, tiny shapes

1. gpu_tests: `pytest -m gpu tests/gpu` in a subprocess: every correctness check on the device
   (parity with HF transformers, batch invariance, the attention backends, CUDA graphs, sampling,
   the prefix cache and its tiers, speculation, quantization, LoRA, vision) is a test there,
   written once. The report keeps the counts (passed, failed, errors, skipped) and each test's
   outcome; a run that passes no test (no CUDA, no transformers) fails. `--dry-run` runs them
   with `--accel-device cpu`.
2. throughput: a Llama-3.1-8B-shaped model with random bf16 weights decoding at batch 1, 64 and
   256 over a 2k context (distinct KV blocks per sequence, no prefix sharing), against the
   roofline (weight + KV bytes per step over 4.8 TB/s, FLOPs over 790 TFLOP/s) and against HF
   `generate` on the same weights (its decode steps timed by a logits processor); some decode
   steps profiled (kernel time against wall time). What could not run (past `--budget-s`, no
   transformers) fails the part rather than passing it.
3. startup: the same weights at the model's full context (131,072 tokens, Llama 3.1's RoPE
   scaling) in an engine given nothing but the model: the memory plan of the default
   `gpu_memory_utilization` (weights, profiled activation peak, KV cache, maximum concurrency),
   each start-up phase's time, and one request of the whole context served.

The report carries its provenance (loadtests/lib/provenance.py). The GPU machine's copy of the
tree has no git history, so the report names no clean commit, but records its source digest:
`--from REPORT ... --result docs/results/device_check.json` on a clean checkout whose source has
the same digest writes the docs' result file with that checkout's commit.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from loadtests.lib import provenance  # noqa: E402
from loadtests.lib.checkpoints import SHAPES, write_random_checkpoint  # noqa: E402
from loadtests.lib.result_schema import PROVENANCE_KEYS  # noqa: E402
from loadtests.lib.results import RefusedResult, write_result  # noqa: E402
from loadtests.lib.rooflines import sync  # noqa: E402
from loadtests.lib.startup import full_context_startup, long_context_copy  # noqa: E402
from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.engine.scheduler import ScheduledSeq  # noqa: E402
from model.models.reference_configs import REFERENCE_CONFIGS  # noqa: E402
from model.engine.sequence import Sequence  # noqa: E402
from model.sampling.sampler import SamplingRow  # noqa: E402

logger = logging.getLogger("device_check")
GPU_TESTS = ROOT / "tests" / "gpu"
HBM_BYTES_PER_S = 4.8e12  # H200
PEAK_FLOPS = 790e12  # H200 dense bf16, about
PARTS = ("gpu_tests", "throughput", "startup")


@dataclass(frozen=True)
class Sizes:
    device: str
    dtype: torch.dtype
    shape: str  # the throughput model: a name of loadtests/lib/checkpoints.py's SHAPES
    batches: tuple[int, ...]
    context: int
    steps: int  # timed decode steps per batch
    block_size: int = 16
    # (attention_backend, enforce_eager) of the engine's throughput runs; gather runs the first two batches
    throughput_configs: tuple = (("flex", False), ("gather", False))
    warm_steps: int = 3
    long_context: int = 131072  # the startup part's max_model_len
    rope_scaling: dict | None = None  # the startup part's, for a context past the shape's own


FULL = Sizes("cuda", torch.bfloat16, "llama3.1-8b-shape", (1, 64, 256), 2048, 32,
             rope_scaling=REFERENCE_CONFIGS["meta-llama/Llama-3.1-8B"]["rope_scaling"])
# The dry run walks the same code with less of everything, in float32 (bf16 matmuls are slow on
# CPUs without bf16 units).
DRY = Sizes("cpu", torch.float32, "tiny-llama-shape", (1, 4), 48, 2, throughput_configs=(("auto", False),),
            warm_steps=1, long_context=2048)


@dataclass
class Check:
    name: str
    status: str = "pass"  # pass | fail | error | skipped
    detail: dict = field(default_factory=dict)
    seconds: float = 0.0


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def have_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# ---- 1. the GPU tests -------------------------------------------------------------------------

def run_gpu_tests(tests: Path, device: str, work: Path, extra: list[str], timeout_s: float) -> Check:
    """`pytest -m gpu TESTS --accel-device DEVICE` in a subprocess (the tests' device memory stays
    out of the benchmark's process); the counts and each test's outcome from its JUnit XML."""
    xml = work / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", str(tests), "--accel-device", device, "-q",
           "-p", "no:cacheprovider", f"--junitxml={xml}", *extra]
    detail: dict = {"command": shlex.join(["python", *cmd[1:]])}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return Check("gpu_tests", "error", detail | {"error": f"pytest ran past {timeout_s:.0f} s",
                                                     "output_tail": out[-3000:]})
    detail["returncode"] = proc.returncode
    if not xml.is_file():
        return Check("gpu_tests", "error", detail | {"error": "pytest wrote no report",
                                                     "output_tail": (proc.stdout + proc.stderr)[-3000:]})
    detail |= junit_outcomes(xml)
    ok = proc.returncode == 0 and detail["passed"] > 0  # nothing passed: nothing was checked
    if not ok:
        detail["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
    return Check("gpu_tests", "pass" if ok else "fail", detail)


def junit_outcomes(xml: Path) -> dict:
    """The counts of a pytest JUnit XML report (passed, failed, errors, skipped) and each test's
    outcome, seconds and (for a test that did not pass) message."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    tests = []
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", None
        for child, name in (("error", "errors"), ("failure", "failed"), ("skipped", "skipped")):
            found = case.find(child)
            if found is not None:
                outcome, message = name, (found.get("message") or "")[:300]
                break
        counts[outcome] += 1
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0.0), 2), **({"message": message} if message else {})})
    return counts | {"tests": tests}


# ---- 2. throughput ----------------------------------------------------------------------------

@dataclass
class Throughput:
    engine: str  # "qkv flex+graphs", "qkv gather+graphs", "hf generate"
    batch: int
    context: int
    step_ms: float
    tokens_per_s: float
    roofline_step_ms: float
    roofline_fraction: float
    bytes_per_step: float
    flops_per_step: float


def roofline(cfg: dict, n_params: int, batch: int, context: int) -> tuple[float, float, float]:
    """(bytes, flops, seconds) of one decode step: every weight but the input embedding's rows
    is read once, every sequence reads its K/V; 2 FLOPs per weight per token plus attention."""
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    d = h // heads
    read = n_params - cfg["vocab_size"] * h  # the embedding table is read a row per token
    kv_bytes = batch * context * 2 * layers * cfg["num_key_value_heads"] * d * 2
    weight_bytes = read * 2 + batch * h * 2
    flops = 2 * read * batch + 4 * batch * context * layers * heads * d
    seconds = max((weight_bytes + kv_bytes) / HBM_BYTES_PER_S, flops / PEAK_FLOPS)
    return weight_bytes + kv_bytes, flops, seconds


def param_count(cfg: dict) -> int:
    """Parameters of an untied Llama of `cfg`'s fields (head_dim = hidden / heads)."""
    h, layers, heads, kv = (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                            cfg["num_key_value_heads"])
    d = h // heads
    return 2 * cfg["vocab_size"] * h + h + layers * (2 * h + 2 * h * heads * d + 2 * h * kv * d
                                                     + 3 * h * cfg["intermediate_size"])


def check_throughput(s: Sizes, work: Path, deadline: float, profile_steps: int = 0,
                     hf_too: bool = True) -> tuple[Check, list[Throughput]]:
    check, rows = Check("throughput"), []
    cfg = SHAPES[s.shape]
    t0 = time.perf_counter()
    directory = checkpoint(s, work)
    n_params = param_count(cfg)
    check.detail["write_s"] = round(time.perf_counter() - t0, 1)
    check.detail["params"] = n_params
    free(s.device)
    for backend, eager in s.throughput_configs:
        batches = s.batches if backend != "gather" else s.batches[:2]
        if time.perf_counter() > deadline:
            check.detail[f"skipped_{backend}"] = "time budget"
            check.status = "fail"
            continue
        profiles: dict = {}
        rows += engine_throughput(s, directory, n_params, backend, eager, batches, profile_steps, profiles)
        if profiles:
            check.detail.setdefault("profiles", {}).update(profiles)
    if not hf_too:
        check.detail["hf"] = "not asked for (--no-hf)"
    elif not have_transformers():
        check.detail["skipped_hf"] = "transformers is not installed"
        check.status = "fail"
    elif time.perf_counter() < deadline:
        import transformers

        hf = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=s.dtype).to(s.device).eval()
        for batch in s.batches:
            if time.perf_counter() > deadline:
                check.detail[f"skipped_hf_batch{batch}"] = "time budget"
                check.status = "fail"
                continue
            try:
                rows.append(hf_throughput(s, hf, n_params, batch))
            except torch.OutOfMemoryError:
                check.detail[f"hf_batch{batch}"] = "out of memory"
                free(s.device)
        del hf
        free(s.device)
    else:
        check.detail["skipped_hf"] = "time budget"
        check.status = "fail"
    return check, rows


def run_part(name: str, part: Callable[[], Check]) -> Check:
    """A benchmark part, timed; an exception it raises is its check's error, and the run goes on."""
    t0 = time.perf_counter()
    try:
        check = part()
    except Exception as exc:
        check = Check(name, "error", {"error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc(limit=6)})
    check.seconds = round(time.perf_counter() - t0, 1)
    logger.info("%s: %s (%.1f s)", name, check.status, check.seconds)
    return check


def checkpoint(s: Sizes, work: Path) -> Path:
    """The shape's random checkpoint, written once for every part that runs it."""
    directory = work / s.shape
    return directory if (directory / "config.json").is_file() else write_random_checkpoint(
        directory, s.shape, s.dtype, device=s.device)


def check_startup(s: Sizes, work: Path) -> Check:
    """3. The engine at the model's full context and the default memory share; passes when the
    full-context request got all its tokens."""
    directory = long_context_copy(checkpoint(s, work), work / f"{s.shape}-long", s.long_context, s.rope_scaling)
    free(s.device)
    detail = full_context_startup(directory, s.device, s.dtype, SHAPES[s.shape]["vocab_size"])
    free(s.device)
    ok = detail["max_model_len"] == s.long_context and detail["finish_reason"] == "length"
    return Check("startup", "pass" if ok else "fail", detail)


@torch.inference_mode()
def engine_throughput(s: Sizes, directory: Path, n_params: int, backend: str, eager: bool,
                      batches: tuple[int, ...], profile_steps: int = 0,
                      profiles: dict | None = None) -> list[Throughput]:
    """Decode steps of `batch` sequences whose `context` positions are cached in distinct blocks
    (the cache holds zeros: the same bytes move), driven through the runner as the engine does."""
    warm = s.warm_steps
    per_seq = -(-(s.context + warm + s.steps + profile_steps + 1) // s.block_size)
    cfg = EngineConfig(max_num_seqs=max(batches), num_kv_blocks=max(batches) * per_seq, block_size=s.block_size,
                       max_model_len=per_seq * s.block_size, enable_prefix_caching=False,
                       attention_backend=backend, enforce_eager=eager)
    llm = LLM(str(directory), device=s.device, dtype=str(s.dtype).removeprefix("torch."), engine_config=cfg)
    runner, out = llm.engine.runner, []
    name = f"qkv {runner.backend}{'' if eager or s.device != 'cuda' else '+graphs'}"
    vocab = SHAPES[s.shape]["vocab_size"]
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        seqs = []
        for i in range(batch):
            seq = Sequence(f"t{i}", torch.randint(1, vocab, (s.context,), generator=g).tolist(), greedy(10**6))
            seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
            seq.num_computed_tokens = s.context - 1
            seqs.append(seq)
        rows = [SamplingRow(q.params, q.prompt_token_ids, q.output_token_ids, None, []) for q in seqs]

        def step(seqs: list[Sequence] = seqs, rows: list[SamplingRow] = rows) -> None:
            toks, _ = runner.run([ScheduledSeq(q, 1) for q in seqs], rows)
            for q, t in zip(seqs, toks):
                q.output_token_ids.append(t)
                q.num_computed_tokens += 1

        for i in range(warm + s.steps):
            if i == warm:
                sync(s.device)
                t0 = time.perf_counter()
            step()
        sync(s.device)
        step_s = (time.perf_counter() - t0) / s.steps
        out.append(_row(name, s, n_params, batch, step_s))
        logger.info("%s batch %d: %.2f ms/step", name, batch, step_s * 1e3)
        if profile_steps and profiles is not None:
            profiles[f"{name} batch {batch}"] = profile_decode(s, step, profile_steps)
    del llm
    free(s.device)
    return out


def profile_decode(s: Sizes, step, n: int) -> dict:
    """Where a decode step's time goes: wall time per step against the time the device ran
    kernels (a step far above its kernels' time waits on the host), and the kernels that took most."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            sync(s.device)
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            sync(s.device)
            wall = (time.perf_counter() - t0) / n
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / n
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
        cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                     key=lambda e: -e.self_cpu_time_total)[:8]
        result = {"steps": n, "wall_ms_per_step": round(wall * 1e3, 3),
                  "kernel_ms_per_step": round(busy / 1e3, 3), "kernels_per_step": round(len(kernels) / n, 1),
                  "top_kernels": [{"name": k[:90], "ms_per_step": round(sum(v) / n / 1e3, 3), "calls_per_step": len(v) / n}
                                  for k, v in top],
                  "top_cpu_ops": [{"name": e.key[:60], "self_ms_per_step": round(e.self_cpu_time_total / n / 1e3, 3)}
                                  for e in cpu]}
        logger.info("profile: wall %.2f ms/step, kernels %.2f ms/step", result["wall_ms_per_step"],
                    result["kernel_ms_per_step"])
        return result
    except Exception as exc:  # a profile is extra: its failure is recorded, the check's figures stay
        return {"error": f"{type(exc).__name__}: {exc}"}


def hf_throughput(s: Sizes, hf, n_params: int, batch: int) -> Throughput:
    """HF `generate` (greedy, its default dynamic cache, SDPA) at `batch` over `context`-token
    prompts; the decode steps are timed between calls of a logits processor."""
    import transformers

    stamps: list[float] = []

    def clock(input_ids, scores):
        sync(s.device)
        stamps.append(time.perf_counter())
        return scores

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, SHAPES[s.shape]["vocab_size"], (batch, s.context), generator=g).to(s.device)
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.steps + 1, min_new_tokens=s.steps + 1,
                    do_sample=False, pad_token_id=0,
                    logits_processor=transformers.LogitsProcessorList([clock]))
    step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    free(s.device)
    logger.info("hf generate batch %d: %.2f ms/step", batch, step_s * 1e3)
    return _row("hf generate", s, n_params, batch, step_s)


def _row(name: str, s: Sizes, n_params: int, batch: int, step_s: float) -> Throughput:
    nbytes, flops, roof = roofline(SHAPES[s.shape], n_params, batch, s.context)
    return Throughput(name, batch, s.context, round(step_s * 1e3, 3), round(batch / step_s, 1), round(roof * 1e3, 3),
                      round(roof / step_s, 3), nbytes, flops)


# ---- the run ----------------------------------------------------------------------------------

def environment(s: Sizes) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": s.device}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if s.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    try:
        import flash_attn  # noqa: F401

        env["flash_attn"] = flash_attn.__version__
    except ImportError:
        env["flash_attn"] = None
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the whole sequence on the CPU with tiny shapes")
    ap.add_argument("--out", default="device_check.json", help="where the report goes")
    ap.add_argument("--tests", type=Path, default=GPU_TESTS, help="the GPU tests pytest runs (default: tests/gpu)")
    ap.add_argument("--pytest-args", default="", help="more pytest arguments, e.g. \"-k parity -x\"")
    ap.add_argument("--tests-timeout-s", type=float, default=900.0, help="the GPU tests' time limit")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="throughput parts that would start after this many seconds are skipped")
    ap.add_argument("--profile-steps", type=int, default=5,
                    help="decode steps profiled per throughput batch (kernel time against wall time); 0: none")
    ap.add_argument("--batches", default="", help="throughput batches, e.g. 1,64 (default: 1,64,256)")
    ap.add_argument("--backends", default="", help="throughput backends, e.g. flex (default: flex,gather)")
    ap.add_argument("--no-hf", action="store_true", help="no HF generate throughput")
    ap.add_argument("--result", default=None,
                    help="also write the docs' result file here (loadtests/lib/results.py's schema: "
                         "throughput table, checks and profile tables, the report under raw)")
    ap.add_argument("--from", dest="from_reports", nargs="+", default=None, metavar="REPORT",
                    help="write --result from saved reports instead of running: the first gives the throughput "
                         "and the checks, a check that failed there is taken from a later report that ran it, "
                         "and every report's profiles are listed")
    ap.add_argument("--note", default=None, help="the result file's note")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="write a docs/results/ file from reports of a tree with uncommitted changes (recorded)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: " + ", ".join(PARTS))
    args = ap.parse_args(argv)
    if args.from_reports and not args.result:
        ap.error("--from needs --result")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_reports:
        return write_docs_result_or_say_why(args, [json.loads(Path(r).read_text()) for r in args.from_reports])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("model", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    s = DRY if args.dry_run else FULL
    if args.batches:
        s = replace(s, batches=tuple(int(b) for b in args.batches.split(",")))
    if args.backends:
        s = replace(s, throughput_configs=tuple(c for c in s.throughput_configs
                                                if c[0] in args.backends.split(",")))
    if s.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU sequence", file=sys.stderr)
        return 2
    start = time.perf_counter()
    run = provenance.start(args.allow_dirty)  # the device's copy may have no .git: its source digest then
    skip = set(filter(None, args.skip.split(",")))
    checks: list[Check] = []
    rows: list[Throughput] = []

    def report(rooflines: bool = False) -> dict:  # written after every part
        out = {"dry_run": args.dry_run, **provenance.stamp(run, s.device, rooflines), "environment": environment(s),
               "elapsed_s": round(time.perf_counter() - start, 1),
               "hbm_bytes_per_s": HBM_BYTES_PER_S, "peak_flops": PEAK_FLOPS,
               "checks": [asdict(c) for c in checks], "throughput": [asdict(r) for r in rows]}
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        return out

    with tempfile.TemporaryDirectory(prefix="qkv-device-check-") as tmp:
        work = Path(tmp)
        if "gpu_tests" in skip:
            checks.append(Check("gpu_tests", "skipped"))
        else:
            t0 = time.perf_counter()
            check = run_gpu_tests(args.tests, s.device, work, shlex.split(args.pytest_args), args.tests_timeout_s)
            check.seconds = round(time.perf_counter() - t0, 1)
            logger.info("gpu_tests: %s (%.1f s)", check.status, check.seconds)
            checks.append(check)
        report()
        if "throughput" in skip:
            checks.append(Check("throughput", "skipped"))
        else:
            def throughput() -> Check:
                check, got = check_throughput(s, work, start + args.budget_s, args.profile_steps, not args.no_hf)
                rows.extend(got)
                return check

            checks.append(run_part("throughput", throughput))
        report()
        if "startup" in skip:
            checks.append(Check("startup", "skipped"))
        else:
            checks.append(run_part("startup", lambda: check_startup(s, work)))
    final = report(rooflines=True)  # the machine's bounds, measured after the benchmark
    print_table(final)
    written = write_docs_result_or_say_why(args, [final]) if args.result else 0
    return written or (0 if all(c.status in ("pass", "skipped") for c in checks) else 1)


def write_docs_result_or_say_why(args: argparse.Namespace, reports: list[dict]) -> int:
    """`write_docs_result` of `reports` to --result: 0, or 2 with the reason it was refused."""
    try:
        write_docs_result(args.result, reports, args.note, args.allow_dirty)
    except RefusedResult as exc:
        print(f"no result file: {exc}", file=sys.stderr)
        return 2
    return 0


def check_summary(check: dict) -> str:
    detail = {k: v for k, v in check["detail"].items()
              if k not in ("traceback", "rows", "profiles", "tests", "output_tail", "command")}
    return json.dumps(detail)


def write_docs_result(path: str, reports: list[dict], note: str | None, allow_dirty: bool = False) -> dict:
    """The docs' result file (docs/results/device_check.json) of saved reports: the first report's
    throughput and checks; a check it failed that a later report passed is shown from the later one
    with the row saying so; each report's decode-step profiles in a table of their own. The
    reports must have run the same code: their provenance, adopted by this checkout where they
    name no clean commit (loadtests.lib.provenance.adopt), is the file's."""
    stamps = [provenance.adopt({k: r[k] for k in PROVENANCE_KEYS if k in r}) for r in reports]
    code = {(st.get("commit"), st.get("dirty"), st.get("source_digest")) for st in stamps}
    if len(code) > 1:
        raise ValueError(f"the reports ran different code (commit, dirty, source digest): {sorted(map(str, code))}")
    first = reports[0]
    env = first["environment"]
    checks, taken_from = {c["name"]: c for c in first["checks"]}, {}
    for i, later in enumerate(reports[1:], start=2):
        for c in later["checks"]:
            if c["status"] == "pass" and checks.get(c["name"], {}).get("status") not in ("pass", None):
                checks[c["name"]], taken_from[c["name"]] = c, i
    check_rows = [[name, c["status"], c["seconds"],
                   (f"report {taken_from[name]} (report 1: {first_status}); " if name in taken_from else "")
                   + check_summary(c)[:300]]
                  for name, c in checks.items()
                  for first_status in [next(x["status"] for x in first["checks"] if x["name"] == name)]]
    rows = [[r["engine"], r["batch"], r["context"], r["step_ms"], r["tokens_per_s"], r["roofline_step_ms"],
             round(100 * r["roofline_fraction"], 1)] for r in first["throughput"]]
    profile_rows = []
    for i, rep in enumerate(reports, start=1):
        for c in rep["checks"]:
            for name, prof in c["detail"].get("profiles", {}).items():
                if "error" in prof:
                    continue
                top = prof["top_kernels"][0] if prof["top_kernels"] else {"name": "", "ms_per_step": 0}
                profile_rows.append([i, name, prof["wall_ms_per_step"], prof["kernel_ms_per_step"],
                                     prof["kernels_per_step"], f"{top['name'][:60]} ({top['ms_per_step']} ms)"])
    stamp = dict(stamps[0])
    if len(reports) > 1:
        stamp["command"] = "; ".join(f"report {i}: {r.get('command')}" for i, r in enumerate(reports, start=1))
    if allow_dirty:
        stamp["allow_dirty"] = True
    # bounds a report cut off before its end did not measure: absent, not invented
    stamp["machine"] = {"copy_bandwidth_gb_s": None, "matmul_peak_gflops": None, **stamp.get("machine", {}),
                        "cuda": env.get("cuda"), "transformers": env.get("transformers")}
    tables = {"checks": (["check", "status", "s", "detail"], check_rows)}
    if profile_rows:
        tables["profile"] = (["report", "engine and batch", "wall ms/step (profiled)", "kernel ms/step", "kernels/step",
                              "largest kernel"], profile_rows)
    return write_result(path, "device_check",
                        ["engine", "batch", "context", "ms/step", "tokens/s", "roofline ms", "% of roofline"], rows,
                        raw=reports, note=note, tables=tables, stamp=stamp,
                        title="The GPU device check: decode throughput of a Llama-3.1-8B shape")


def print_table(report: dict) -> None:
    env = report["environment"]
    print(f"\ndevice check on {env.get('gpu', env['device'])} (torch {env['torch']}), {report['elapsed_s']} s")
    print(f"{'check':<18}{'status':<9}{'s':>7}  detail")
    for c in report["checks"]:
        print(f"{c['name']:<18}{c['status']:<9}{c['seconds']:>7}  {check_summary(c)[:160]}")
    for c in report["checks"]:
        for t in c["detail"].get("tests", []):
            if t["outcome"] not in ("passed", "skipped"):
                print(f"  {t['outcome']}: {t['test']}  {t.get('message', '')[:120]}")
    if report["throughput"]:
        print(f"\n{'engine':<22}{'batch':>6}{'ctx':>6}{'ms/step':>10}{'tok/s':>11}{'roof ms':>9}{'of roof':>9}")
        for r in report["throughput"]:
            print(f"{r['engine']:<22}{r['batch']:>6}{r['context']:>6}{r['step_ms']:>10.2f}{r['tokens_per_s']:>11.0f}"
                  f"{r['roofline_step_ms']:>9.2f}{r['roofline_fraction']:>9.1%}")


if __name__ == "__main__":
    sys.exit(main())
