"""The engine against llama.cpp on this CPU, back to back on the same weights, in one run.

llama.cpp is built from the tree vendored in the `llama-cpp-python` sdist on PyPI (cmake,
`-DGGML_NATIVE=ON`, llama-batched-bench and llama-quantize only; about 20 minutes on 2 cores the
first time, then cached under `--cache`). Each shape is a random checkpoint (GPT-2 small: the
preset's layout; Qwen2.5-0.5B and Llama-3.2-1B: loadtests/tools/random_checkpoint.py) with a
small byte-level BPE tokenizer, converted to an f32 GGUF by llama.cpp's own convert_hf_to_gguf.py
and quantized by llama-quantize (Q8_0, Q4_0, Q4_K_M).

Both engines run llama-batched-bench's workload with 2 threads: `npl` sequences of `npp` random
prompt tokens prefilled together (prefill tok/s: npl * npp over the time to every first
logit), then `ntg` decode steps of all `npl` sequences (generation tok/s: npl * ntg over their
time). The engine side steps `LLM.engine` directly, prefix caching off (llama-batched-bench
clears its cache between rows), as bench_engine's decode_rate does. Pairs: f32 with the
engine's float32, Q8_0 with int8 (per output channel), Q4_0 (groups of 32) and Q4_K_M with int4
(groups of `--group`, the LM head float as by default) and Q4_0 again with int4+head (the
head quantized too: llama-quantize writes a Q6_K output tensor in its Q4 files).

    .venv/bin/python loadtests/benchmarks/bench_llama_cpp.py --out docs/results/bench_llama_cpp.json
    .venv/bin/python loadtests/benchmarks/bench_llama_cpp.py --quick   # a tiny Llama shape: checks it runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from loadtests.benchmarks.bench_engine import PRESET as GPT2_PRESET, checkpoint  # noqa: E402
from loadtests.tools.random_checkpoint import SHAPES  # noqa: E402
from loadtests.tools.results import add_result_args, cpu_model, print_table, write_result  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built (its ggml commit is in the result)
BINARIES = ("llama-batched-bench", "llama-quantize")
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DBUILD_SHARED_LIBS=OFF"]

SHAPES.setdefault("llama3.2-1b-shape", {  # meta-llama/Llama-3.2-1B: 1.24B parameters, GQA 32:8, tied head
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "hidden_act": "silu", "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001,
})


@dataclass(frozen=True)
class Workload:
    """One llama-batched-bench invocation: `npl` sequence counts of `npp` prompt + `ntg` new tokens."""
    kind: str  # "generation" (the row reports decode tok/s) or "prefill" (prompt tok/s)
    npp: int
    ntg: int
    npl: tuple[int, ...]


# shape -> (source, workloads). Llama-3.2-1B runs fewer rows: its 16-prompt prefill alone is minutes a side
# Batch 1 decodes 128 tokens: 32 (well under a second) varied by a third between two runs of llama.cpp.
SHAPE_RUNS: dict[str, tuple[str, tuple[Workload, ...]]] = {
    "gpt2-small": (GPT2_PRESET, (Workload("generation", 128, 128, (1,)), Workload("generation", 128, 32, (16, 64)),
                                 Workload("prefill", 512, 1, (1, 16)))),
    "qwen2.5-0.5b-shape": ("qwen2.5-0.5b-shape", (Workload("generation", 128, 128, (1,)),
                                                  Workload("generation", 128, 32, (16, 64)),
                                                  Workload("prefill", 512, 1, (1, 16)))),
    "llama3.2-1b-shape": ("llama3.2-1b-shape", (Workload("generation", 128, 64, (1,)),
                                                Workload("generation", 128, 32, (16,)),
                                                Workload("prefill", 512, 1, (1,)))),
    "tiny-llama-shape": ("tiny-llama-shape", (Workload("generation", 32, 8, (1, 4)), Workload("prefill", 64, 1, (1, 4)))),
}
# (our scheme, llama.cpp's types it is compared with); the first is the float baseline
# (int4+head: the LM head quantized too, as llama.cpp's files have it; the engine's default keeps it
# float: loadtests/benchmarks/quant_accuracy.py measured +5% bits per byte for the head at group 128)
PAIRS = (("float32", ("f32",)), ("int8", ("Q8_0",)), ("int4", ("Q4_0", "Q4_K_M")), ("int4+head", ("Q4_0",)),
         ("int8+a8", ("Q8_0",)), ("int4+a8", ("Q4_0",)), ("int4+head+a8", ("Q4_0",)),  # a8: int8 activations
         ("int8+head8+a8", ("Q8_0",)), ("int4+head8+a8", ("Q4_0",)))  # head8: the int8 LM head (the CPU default)
# issue 42's targets, as (our scheme, row) -> the least ratio against llama.cpp's pair
TARGETS = {("float32", "decode b1"): 1.0, ("float32", "gen b16"): 1.5, ("float32", "gen b64"): 1.5,
           ("float32", "prefill 16x512"): 1.0, ("int8", "decode b1"): 1.0, ("int8", "gen b16"): 1.5,
           ("int8", "gen b64"): 1.5, ("int4", "decode b1"): 1.0, ("int4", "gen b16"): 1.5, ("int4", "gen b64"): 1.5}


def row_name(work: Workload, npl: int) -> str:
    if work.kind == "prefill":
        return f"prefill {npl}x{work.npp}"
    return "decode b1" if npl == 1 else f"gen b{npl}"


# --- llama.cpp: source, build, conversion ------------------------------------------------------------

def llama_cpp_tree(cache: Path, version: str = LLAMA_CPP_PYTHON) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist, downloaded from the package index once."""
    tree = cache / f"llama-cpp-python-{version}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
                    "--no-deps", "--no-build-isolation", "-d", str(cache)], check=False)
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():  # pip download builds metadata; without isolation that needs scikit-build-core
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary",
                        ":all:", "--no-deps", "-d", str(cache)], check=True)
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        tar.extractall(cache, filter="data")
    (cache / top).rename(cache / f"llama-cpp-python-{version}")
    return tree


def build_llama_cpp(tree: Path, jobs: int) -> Path:
    """The directory of the built binaries (built once: cmake skips what is up to date)."""
    bin_dir = tree / "build" / "bin"
    if all((bin_dir / b).exists() for b in BINARIES):
        return bin_dir
    print(f"building llama.cpp in {tree / 'build'} (about 20 minutes on 2 cores)", flush=True)
    generator = ["-G", "Ninja"] if subprocess.run(["which", "ninja"], capture_output=True).returncode == 0 else []
    subprocess.run(["cmake", "-S", str(tree), "-B", str(tree / "build"), *generator, *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(tree / "build"), "-j", str(jobs), "--target", *BINARIES], check=True)
    return bin_dir


# convert_hf_to_gguf.py identifies a BPE pre-tokenizer by the hash of what it makes of a test
# text and refuses one it does not know; the benchmark's random tokenizer is named here instead.
# Its sentencepiece path imports sentencepiece before it looks for a tokenizer.model, which a
# BPE tokenizer directory has not: that path is told so without the import.
_CONVERT = """
import runpy, sys
sys.path[:0] = [{tree!r}, {gguf_py!r}]
import conversion.base as base
def no_sentencepiece(self, *args, **kwargs):
    raise FileNotFoundError("a BPE tokenizer: no tokenizer.model")
for cls in vars(base).values():
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
    if isinstance(cls, type) and "_set_vocab_sentencepiece" in vars(cls):
        cls._set_vocab_sentencepiece = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outtype", "f32", "--outfile", {out!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of at most 512 ids (the model's other ids stay unnamed) for
    the converter; neither benchmark tokenizes text: both feed random ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(512, vocab_size), special_tokens=["<|endoftext|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([Path(__file__).read_text()], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(directory))


def convert(tree: Path, bin_dir: Path, ckpt: Path, out_dir: Path, types: list[str]) -> dict[str, Path]:
    """GGUF files of `ckpt`: f32 by the converter, the others by llama-quantize from it."""
    config = json.loads((ckpt / "config.json").read_text())
    if config.get("model_type") == "gpt2" and "n_ctx" not in config:  # transformers 5 writes n_positions only
        config["n_ctx"] = config.get("n_positions", 1024)
        (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(ckpt, config["vocab_size"])
    files = {"f32": out_dir / "model-f32.gguf"}
    code = _CONVERT.format(tree=str(tree), gguf_py=str(tree / "gguf-py"), pre="gpt-2", src=str(ckpt),
                           out=str(files["f32"]), script=str(tree / "convert_hf_to_gguf.py"))
    _run([sys.executable, "-c", code])
    for t in types:
        if t != "f32":
            files[t] = out_dir / f"model-{t}.gguf"
            _run([str(bin_dir / "llama-quantize"), str(files["f32"]), str(files[t]), t, "2"])
    return files


def _run(cmd: list[str]) -> str:
    """Run `cmd`; its output, or an error that carries the end of it."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout + out.stderr


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's `--output-format jsonl` rows (its other output lines are skipped)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"speed_tg"' in line]


def run_llama_cpp(bin_dir: Path, gguf: Path, work: Workload, threads: int, tries: int = 3) -> dict[int, dict]:
    """llama-batched-bench's rows for `work`, by `npl`. Its log is written by a thread that the
    program does not flush before it exits, so the last row is sometimes lost (5 of 20 runs of
    a tiny model here): the rows missing are run again, in a new process, up to `tries` times."""
    rows: dict[int, dict] = {}
    out = ""
    for _ in range(tries):
        npl = [n for n in work.npl if n not in rows]
        if not npl:
            break
        ctx = max(npl) * (work.npp + work.ntg) + 16
        out = _run([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
                    "-npp", str(work.npp), "-ntg", str(work.ntg), "-npl", ",".join(map(str, npl)),
                    "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"])
        rows |= {r["pl"]: r for r in parse_batched_bench(out) if r["pl"] in npl}
    missing = set(work.npl) - set(rows)
    if missing:
        raise RuntimeError(f"llama-batched-bench on {gguf.name} gave no row for npl {sorted(missing)} in {tries} "
                           f"runs:\n{out[-3000:]}")
    return rows


# --- the engine ------------------------------------------------------------------------------------

def engine_batched_bench(llm: LLM, npp: int, ntg: int, npl: int, seed: int = 0) -> dict[str, float]:
    """llama-batched-bench's row on the engine: `npl` random prompts of `npp` tokens prefilled
    (stepping until every one has its first token), then `ntg` steps that each decode one token
    of every sequence. Returns the times and rates under llama-batched-bench's names."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    ids = [f"bb{seed}-{npl}-{i}" for i in range(npl)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(npp)],
                           SamplingParams(max_tokens=ntg + 1, temperature=0.0, ignore_eos=True))
    requests = [engine._requests[rid] for rid in ids]
    t0 = time.perf_counter()
    while any(not r.seq.output_token_ids for r in requests):
        engine.step()
    t_pp = time.perf_counter() - t0
    steps = 0
    t1 = time.perf_counter()
    while steps < ntg and engine.has_unfinished():
        engine.step()
        steps += 1
    t_tg = time.perf_counter() - t1
    done = sum(len(r.seq.output_token_ids) for r in requests)
    while engine.has_unfinished():
        engine.step()
    if done != npl * (ntg + 1):
        raise RuntimeError(f"expected {npl * (ntg + 1)} tokens after {ntg} steps, got {done}")
    return {"pl": npl, "pp": npp, "tg": ntg, "t_pp": t_pp, "speed_pp": npl * npp / t_pp,
            "t_tg": t_tg, "speed_tg": npl * ntg / t_tg if ntg else 0.0}


def engine_config(scheme: str, workloads: tuple[Workload, ...], group: int) -> EngineConfig:
    """`scheme`: float32, int8 or int4, `+head` to quantize the LM head as the layers, `+head8` in
    int8 (else it stays float32), `+a8` for quantization_activations=int8 (llama.cpp's way:
    activations rounded to int8 blocks)."""
    most = max(max(w.npl) for w in workloads)
    tokens = max(max(w.npl) * (w.npp + w.ntg + 1) for w in workloads)
    method, *flags = scheme.split("+")
    return EngineConfig(max_num_seqs=most, num_kv_blocks=tokens // 16 + most + 8, enable_prefix_caching=False,
                        quantization="none" if method == "float32" else method, quantization_group_size=group,
                        quantize_lm_head="int8" if "head8" in flags else "head" in flags,
                        quantization_activations="int8" if "a8" in flags else "float32")


def run_engine(source: str, scheme: str, workloads: tuple[Workload, ...], args: argparse.Namespace) -> list[dict]:
    llm = LLM(source, device="cpu", dtype="float32",
              engine_config=engine_config(scheme, workloads, args.group))
    engine_batched_bench(llm, 16, 2, 1, seed=99)  # warm-up: the kernels' first calls
    rows = []
    for w in workloads:
        for npl in w.npl:
            rows.append({"work": w, "npl": npl, **engine_batched_bench(llm, w.npp, w.ntg, npl, seed=npl)})
    del llm
    gc.collect()
    return rows


# --- the run ---------------------------------------------------------------------------------------

def run_shape(shape: str, tree: Path, bin_dir: Path, tmp: Path, args: argparse.Namespace) -> list[dict]:
    _, workloads = SHAPE_RUNS[shape]
    ckpt = tmp / shape
    checkpoint(SHAPE_RUNS[shape][0], str(ckpt))
    ggufs = convert(tree, bin_dir, ckpt, tmp, [t for _, types in PAIRS for t in types if t in args.types])
    rows = []
    for scheme, types in PAIRS:
        if scheme not in args.schemes:
            continue
        peers = {}
        for t in types:  # back to back: llama.cpp's rows, then the engine's, on the same weights
            if t in ggufs:
                peers[t] = {w: run_llama_cpp(bin_dir, ggufs[t], w, args.threads) for w in workloads}
        ours = run_engine(str(ckpt), scheme, workloads, args)
        for r in ours:
            w, npl = r["work"], r["npl"]
            key = "speed_pp" if w.kind == "prefill" else "speed_tg"
            name = row_name(w, npl)
            for t, by_work in peers.items():
                theirs = by_work[w][npl][key]
                target = TARGETS.get((scheme.partition("+")[0], name)) if t in ("f32", "Q8_0", "Q4_0") else None
                rows.append({"shape": shape, "row": name, "ours": scheme, "llama_cpp": t, "ours_tok_s": r[key],
                             "llama_cpp_tok_s": theirs, "ratio": r[key] / theirs, "target": target,
                             "ours_raw": {k: v for k, v in r.items() if k != "work"},
                             "llama_cpp_raw": by_work[w][npl]})
            print(f"  {shape} {name} {scheme}: {r[key]:.1f} tok/s"
                  + "".join(f", {t} {by_work[w][npl][key]:.1f}" for t, by_work in peers.items()), flush=True)
    base = {(r["row"]): r["ours_tok_s"] for r in rows if r["ours"] == "float32"}
    for r in rows:
        r["ours_vs_float32"] = r["ours_tok_s"] / base[r["row"]] if r["row"] in base else None
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    for g in ggufs.values():
        g.unlink()
    return rows


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    columns = ["shape", "row", "ours", "tok/s", "llama.cpp", "tok/s", "ratio", "target", "ours vs float32"]
    out = []
    for r in rows:
        target = "-" if r["target"] is None else f">= {r['target']:.1f}x " + (
            "reached" if r["ratio"] >= r["target"] else "not reached")
        if r["row"].startswith("prefill") and r["ours"] != "float32":
            target = ">= 1.0x fp32 " + ("reached" if r["ours_vs_float32"] >= 1.0 else "not reached")
        out.append([r["shape"], r["row"], r["ours"], f"{r['ours_tok_s']:.1f}", r["llama_cpp"],
                    f"{r['llama_cpp_tok_s']:.1f}", f"{r['ratio']:.2f}", target,
                    "-" if r["ours_vs_float32"] is None else f"{r['ours_vs_float32']:.2f}"])
    return columns, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["gpt2-small", "qwen2.5-0.5b-shape", "llama3.2-1b-shape"],
                    choices=list(SHAPE_RUNS))
    ap.add_argument("--schemes", nargs="+", default=[s for s, _ in PAIRS], choices=[s for s, _ in PAIRS])
    ap.add_argument("--types", nargs="+", default=["f32", "Q8_0", "Q4_0", "Q4_K_M"],
                    help="llama.cpp's weight types to run (f32 is always converted)")
    ap.add_argument("--group", type=int, default=128, help="the engine's int4 group size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                    / "qkv-serve", help="where llama.cpp's source and build are kept")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs")
    ap.add_argument("--quick", action="store_true", help="the tiny Llama shape, f32 and Q8_0 only")
    add_result_args(ap, "results/bench_llama_cpp.json")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.schemes, args.types = ["tiny-llama-shape"], ["float32", "int8"], ["f32", "Q8_0"]
    torch.set_num_threads(args.threads)
    tree = llama_cpp_tree(args.cache)
    bin_dir = build_llama_cpp(tree, args.jobs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            rows += run_shape(shape, tree, bin_dir, Path(tmp), args)
    columns, table_rows = table(rows)
    print_table(columns, table_rows)
    if args.out:
        raw = {"threads": args.threads, "llama_cpp_python_sdist": LLAMA_CPP_PYTHON, "cmake_flags": CMAKE_FLAGS,
               "int4_group": args.group, "cpu": cpu_model(),
               "workloads": {s: [vars(w) | {"npl": list(w.npl)} for w in SHAPE_RUNS[s][1]] for s in args.shapes},
               "rows": rows}
        write_result(args.out, "bench_llama_cpp", columns, table_rows, raw=raw, note=args.note,
                     title="The engine against llama.cpp, same weights, same threads")


if __name__ == "__main__":
    main()
