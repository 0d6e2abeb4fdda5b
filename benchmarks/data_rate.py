"""Real text: can the streamed BPE data path feed a GPU? Tokenizer and reader throughput on one core, against the
tokens/s the GPU presets consume, and what background prefetch changes.

  * tokenizer: a byte-level BPE (GPT-2's kind) with a 32k vocabulary trained here on the embedded corpus, as a
    stand-in for GPT-2's own (``--tokenizer PATH`` measures a real one saved with ``save_pretrained``); documents
    encoded one call each, ``TOKENIZERS_PARALLELISM=false`` (one core);
  * reader: the embedded corpus written as ``.json.gz`` shards and read by the hub path (``data.stream_files``:
    datasets streaming, shuffle buffer, held-out check, tokenizing, packing) with ``data.prefetch_batches=0``;
  * feeding a GPU: a consumer that asks for one ``--batch`` x ``--seq-len`` batch and then waits, with the GIL
    released like a CUDA sync, for the time a GPU computing at ``--consume`` tokens/s would take; achieved tokens/s
    with prefetch off and on, and with two tokenizer threads (``data.tokenizer_threads``). This simulates the GPU's
    side; it is not a GPU measurement;
  * demand: tokens/s of the GPU presets at 40 % MFU on an H100 (989 TFLOPS bf16) and an RTX 4090 (165), from
    p2p_diloco/train/flops.py (6·N + 12·L·d·T FLOPs per token, gpt2's 50257-token vocabulary).

Run:

    python benchmarks/data_rate.py [--reps 3] [--consume 350000]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core, before tokenizers is imported

import torch  # noqa: E402

from common import median, table  # noqa: E402

from p2p_diloco.config import DataConfig  # noqa: E402
from p2p_diloco.train.corpus import embedded_documents  # noqa: E402
from p2p_diloco.train.data import build_data  # noqa: E402
from p2p_diloco.train.tokenizers import load_tokenizer  # noqa: E402


def train_bpe(folder: Path, vocab_size: int = 32000) -> str:
    """A byte-level BPE trained on the embedded corpus, saved with save_pretrained; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(embedded_documents(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(str(folder))
    return str(folder)


def write_shards(folder: Path, copies: int) -> None:
    """The embedded corpus ``copies`` times (numbered, so no two documents are equal), as two .json.gz shards."""
    docs = [f"{c}. {d}" for c in range(copies) for d in embedded_documents()]
    half = len(docs) // 2
    for i, part in enumerate((docs[:half], docs[half:])):
        with gzip.open(folder / f"part-{i:05d}.json.gz", "wt") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in part)


def tokenizer_rate(tokenizer: str) -> tuple[float, float]:
    """(tokens/s, characters per token) encoding the embedded corpus one document per call, for the first time
    (the tokenizer's word cache is cold: the slower, honest case for text it has not seen)."""
    tok, docs = load_tokenizer(tokenizer), list(embedded_documents())
    start = time.perf_counter()
    tokens = sum(len(tok.encode_documents([d])) for d in docs)
    return tokens / (time.perf_counter() - start), sum(map(len, docs)) / tokens


def data_config(shards: Path, tokenizer: str, prefetch: int, threads: int = 1) -> DataConfig:
    return DataConfig(dataset=str(shards), tokenizer=tokenizer, stream_files=True, prefetch_batches=prefetch,
                      tokenizer_threads=threads, eval_batches=1)


def reader_rate(shards: Path, tokenizer: str, batch: int, seq_len: int, batches: int) -> float:
    """Tokens/s the streamed reader delivers when nothing else runs."""
    reader = build_data(data_config(shards, tokenizer, 0), seq_len, batch, "bench").train
    reader.next_batch()  # opens the files and fills the shuffle buffer
    start = time.perf_counter()
    for _ in range(batches):
        reader.next_batch()
    return batches * batch * seq_len / (time.perf_counter() - start)


def fed_rate(shards: Path, tokenizer: str, batch: int, seq_len: int, batches: int, consume: float,
             prefetch: int, threads: int) -> float:
    """Tokens/s a consumer computing at ``consume`` tokens/s (simulated by waiting) gets from the reader, in the
    steady state (after as many batches as the prefetch queue holds, so a full queue at the start does not count)."""
    reader = build_data(data_config(shards, tokenizer, prefetch, threads), seq_len, batch, "bench").train
    compute_s = batch * seq_len / consume
    for _ in range(prefetch + 2):
        reader.next_batch()
        time.sleep(compute_s)
    start = time.perf_counter()
    for _ in range(batches):
        reader.next_batch()
        time.sleep(compute_s)  # the GPU computes; the training thread waits with the GIL released
    reader.close()
    return batches * batch * seq_len / (time.perf_counter() - start)


def demand_rows() -> list[list]:
    from transformers import AutoModelForCausalLM  # imported here: --help stays quick

    from p2p_diloco.train.flops import flops_per_token
    from p2p_diloco.train.model import preset_config

    rows = []
    for name in ("150m", "400m", "1b"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(preset_config(name, 50257, 1024))
        per_token = flops_per_token(model, 1024)
        rows.append([name, f"{per_token / 1e9:.2f}", f"{0.4 * 989e12 / per_token:,.0f}",
                     f"{0.4 * 165e12 / per_token:,.0f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="a saved tokenizer folder (default: a 32k BPE trained here)")
    parser.add_argument("--reps", type=int, default=3, help="measurements of each (default 3)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch (default 16)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--batches", type=int, default=40, help="batches per measurement (default 40)")
    parser.add_argument("--consume", type=float, default=350_000,
                        help="simulated GPU demand, tokens/s (default 350000: 150m on an H100 at 40%% MFU)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        tmp = Path(tmp)
        tokenizer = args.tokenizer or train_bpe(tmp / "bpe")
        (tmp / "shards").mkdir()
        write_shards(tmp / "shards", copies=6)
        runs = {"tok": [], "reader": [], "off": [], "on": [], "on2": []}
        for rep in range(args.reps):
            rate, chars = tokenizer_rate(tokenizer)
            runs["tok"].append(rate)
            runs["reader"].append(reader_rate(tmp / "shards", tokenizer, args.batch, args.seq_len, args.batches))
            for key, depth, threads in (("off", 0, 1), ("on", 8, 1), ("on2", 8, 2)):
                runs[key].append(fed_rate(tmp / "shards", tokenizer, args.batch, args.seq_len, args.batches,
                                          args.consume, depth, threads))
            print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in runs.items()), flush=True)
        vocab = load_tokenizer(tokenizer).vocab_size
    print(table(["what (one core)", "tokens/s", "runs"],
                [[f"BPE tokenizer alone (vocab {vocab}, {chars:.2f} characters per token)",
                  f"{median(runs['tok']):,.0f}", args.reps],
                 ["streamed reader alone (.json.gz shards, shuffle, tokenize, pack)", f"{median(runs['reader']):,.0f}",
                  args.reps],
                 [f"fed to a consumer of {args.consume:,.0f} tokens/s, prefetch off", f"{median(runs['off']):,.0f}",
                  args.reps],
                 [f"fed to a consumer of {args.consume:,.0f} tokens/s, prefetch 8 batches",
                  f"{median(runs['on']):,.0f}", args.reps],
                 [f"fed to a consumer of {args.consume:,.0f} tokens/s, prefetch 8 batches, 2 tokenizer threads "
                  "(two cores)", f"{median(runs['on2']):,.0f}", args.reps]]))
    print()
    print(table(["preset (vocab 50257, T 1024)", "GFLOPs per token", "tokens/s, H100 at 40 % MFU",
                 "tokens/s, RTX 4090 at 40 % MFU"], demand_rows()))


if __name__ == "__main__":
    main()
