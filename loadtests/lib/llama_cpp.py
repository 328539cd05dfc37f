"""llama.cpp beside the engine: its source (the tree vendored in the `llama-cpp-python` sdist on
PyPI), its build (cmake, `-DGGML_NATIVE=ON`, llama-batched-bench and llama-quantize only; about 20
minutes on 2 cores the first time, then cached), a checkpoint's conversion to GGUF by llama.cpp's
own convert_hf_to_gguf.py and llama-quantize, and llama-batched-bench's workload run on both:
`npl` sequences of `npp` random prompt tokens prefilled together, then `ntg` decode steps of all
`npl` sequences. The engine side steps `LLM.engine` directly."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from model import LLM, SamplingParams
from model.config import EngineConfig

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built (its ggml commit is in the result)
BINARIES = ("llama-batched-bench", "llama-quantize")
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DBUILD_SHARED_LIBS=OFF"]


@dataclass(frozen=True)
class Workload:
    """One llama-batched-bench invocation: `npl` sequence counts of `npp` prompt + `ntg` new tokens."""
    kind: str  # "generation" (the row reports decode tok/s) or "prefill" (prompt tok/s)
    npp: int
    ntg: int
    npl: tuple[int, ...]


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
    """A byte-level BPE tokenizer of at most 512 ids (the model's other ids stay unnamed), trained
    on this file's text, for the converter; neither side tokenizes text: both feed random ids."""
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
    # errors="replace": the converter prints tokens that are not UTF-8, which must not end the run
    out = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
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


def alternating_rates(engines: dict[str, LLM], batches: list[int], rounds: int, steps: int
                      ) -> dict[tuple[str, int], list[float]]:
    """Decode tokens/s of each engine at each batch size (llama-batched-bench's generation row,
    128-token prompts, `steps` decode steps), the engines taking turns round after round so that
    the machine's drift falls on all of them; after one warm-up row each (the kernels' first calls)."""
    for llm in engines.values():
        engine_batched_bench(llm, 16, 2, 1, seed=99)
    rates: dict[tuple[str, int], list[float]] = {(k, b): [] for k in engines for b in batches}
    for _ in range(rounds):
        for b in batches:
            for kind, llm in engines.items():
                rates[kind, b].append(engine_batched_bench(llm, 128, steps, b, seed=b)["speed_tg"])
    return rates


def engine_config(scheme: str, workloads: tuple[Workload, ...], group: int) -> EngineConfig:
    """`scheme`: float32, int8 or int4, `+head` to quantize the LM head as the layers, `+head8` in
    int8 (else it stays float32), `+a8` for quantization_activations=int8 (llama.cpp's way:
    activations rounded to int8 blocks), `+compiled` for the compiled decode step
    (enforce_eager=False)."""
    most = max(max(w.npl) for w in workloads)
    tokens = max(max(w.npl) * (w.npp + w.ntg + 1) for w in workloads)
    method, *flags = scheme.split("+")
    return EngineConfig(max_num_seqs=most, num_kv_blocks=tokens // 16 + most + 8, enable_prefix_caching=False,
                        quantization="none" if method == "float32" else method, quantization_group_size=group,
                        quantize_lm_head="int8" if "head8" in flags else "head" in flags,
                        quantization_activations="int8" if "a8" in flags else "float32",
                        enforce_eager="compiled" not in flags)

