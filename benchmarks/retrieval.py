"""Does an embedding mean something? Sentence pairs (a sentence and its paraphrase)
against unrelated sentences, ranked by each server's vectors; plus inputs a second and
how closely the servers' vectors agree, side by side in one run.

    .venv/bin/python benchmarks/retrieval.py NAME=URL [NAME=URL ...] --pooling mean
        [--pairs 300] [--batch 16] [--rounds 2] [--text FILE ...]

Sentences of 8 to 40 words are cut from plain text (by default the licence texts
Debian ships in /usr/share/common-licenses; each sentence once). A sentence's
paraphrase is made by rules, the same for every run: common words swapped for
synonyms, articles dropped or changed, and the clauses on either side of its first
comma swapped; what it keeps is its meaning, not its wording. For each of --pairs
sentences (a fixed-seed sample) it reports:
  - pair vs unrelated: the share of sentences whose paraphrase is nearer (cosine) than
    a sentence from another family of licence (not the GNU licences against each other);
  - pair vs same text: the same against a sentence from the same licence (harder:
    the same subject and words);
  - recall@1: the share whose nearest paraphrase, among all --pairs, is its own.
And each server's inputs a second (requests of --batch inputs, one at a time, the
servers taking turns, --rounds times), each server's cosine with the first server's
vector of the same input (min and median), and, for the first --alone inputs sent one
a request, each server's vector alone against its own in a batch, and against the
first server's alone.

Each server is asked for `--pooling` (ninfer's `pooling` field; llama-server has no
per-request pooling: start it with `--embeddings --pooling P`, and again for each
pooling) with euclidean normalization, on `/v1/embeddings`.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from embeddings import DEFAULT_TEXTS
from embeddings import sentences as split_sentences

SYNONYMS = {
    "software": "programs",
    "program": "software",
    "copy": "duplicate",
    "copies": "duplicates",
    "distribute": "pass on",
    "distribution": "passing on",
    "modify": "change",
    "modified": "changed",
    "modifications": "changes",
    "permission": "consent",
    "license": "licence",
    "licenses": "licences",
    "work": "creation",
    "works": "creations",
    "rights": "entitlements",
    "terms": "provisions",
    "conditions": "requirements",
    "provided": "supplied",
    "must": "has to",
    "may": "is allowed to",
    "shall": "will",
    "without": "lacking",
    "including": "among them",
    "include": "contain",
    "use": "employ",
    "used": "employed",
    "make": "produce",
    "made": "produced",
    "give": "grant",
    "free": "unrestricted",
    "original": "initial",
    "new": "fresh",
    "each": "every",
    "other": "further",
    "above": "earlier",
    "following": "next",
    "available": "obtainable",
    "published": "issued",
    "apply": "hold",
    "applicable": "relevant",
    "purpose": "aim",
    "party": "side",
    "parties": "sides",
    "law": "legislation",
    "file": "document",
    "document": "text",
    "notice": "statement",
    "notices": "statements",
    "warranty": "guarantee",
    "copyright": "authorship right",
    "holder": "owner",
    "convey": "pass along",
    "combined": "merged",
    "based": "built",
    "particular": "specific",
    "means": "signifies",
    "covered": "concerned",
    "such": "those",
    "any": "whatever",
    "all": "every one of the",
    "not": "never",
    "if": "in case",
    "under": "according to",
    "also": "as well",
    "only": "solely",
    "otherwise": "else",
    "user": "person using it",
    "code": "source text",
    "library": "shared code",
}
ARTICLES = {"the": "", "a": "", "an": "", "this": "that", "these": "those"}


def sentences(files: list[str]) -> list[tuple[str, str]]:
    """(file, sentence) for each distinct sentence of 8 to 40 words."""
    seen: set[str] = set()
    out = []
    for f in files:
        for text in split_sentences([f]):  # a file at a time: each sentence keeps its file
            letters = sum(c.isalpha() for c in text)
            fits = 8 <= text.count(" ") + 1 <= 40 and letters > 0.7 * len(text)
            if fits and text.lower() not in seen:
                seen.add(text.lower())
                out.append((Path(f).name, text))
    return out


def _family(name: str) -> str:
    base = name.split("-")[0]
    return "GPL" if base in ("GPL", "LGPL", "GFDL") else base


def paraphrase(text: str) -> str:
    """The same sentence in other words, by rule (no randomness)."""
    head, comma, tail = text.partition(", ")
    if comma and tail.count(" ") >= 3 and head.count(" ") >= 3:
        text = tail.rstrip(".;?") + ", " + head[0].lower() + head[1:] + "."
    words = []
    for w in text.split():
        core = re.sub(r"\W+$", "", w)
        trail = w[len(core) :]
        low = core.lower()
        if low in ARTICLES:
            swap = ARTICLES[low]
        elif low in SYNONYMS:
            swap = SYNONYMS[low]
        else:
            words.append(w)
            continue
        if swap:
            words.append(swap + trail)
        elif trail and words:  # a dropped word's punctuation stays with the word before
            words[-1] += trail
    out = " ".join(words)
    return out[0].upper() + out[1:] if out else text


def embed(c: httpx.Client, texts: list[str], pooling: str, batch: int) -> np.ndarray:
    rows = []
    for i in range(0, len(texts), batch):
        body = {"input": texts[i : i + batch], "encoding_format": "float", "pooling": pooling}
        r = c.post("/v1/embeddings", json=body)
        r.raise_for_status()
        rows += [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    v = np.asarray(rows, dtype=np.float64)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("servers", nargs="+", help="NAME=URL")
    ap.add_argument("--pooling", default="mean", choices=["mean", "last", "cls"])
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--alone", type=int, default=32, help="inputs also sent one a request")
    ap.add_argument("--text", action="append", default=None)
    args = ap.parse_args()
    servers = [s.split("=", 1) for s in args.servers]

    pool = sentences(args.text or DEFAULT_TEXTS)
    rng = random.Random(0)
    picked = rng.sample(range(len(pool)), min(args.pairs, len(pool)))
    originals = [pool[i][1] for i in picked]
    paraphrases = [paraphrase(t) for t in originals]
    unrelated, same_text = [], []
    for i in picked:
        name = pool[i][0]
        # another family's text (GPL-2 and LGPL-3 are one family: they share sentences)
        others = [j for j in range(len(pool)) if _family(pool[j][0]) != _family(name)]
        mates = [j for j in range(len(pool)) if pool[j][0] == name and j != i]
        unrelated.append(pool[rng.choice(others)][1])
        same_text.append(pool[rng.choice(mates)][1] if mates else pool[rng.choice(others)][1])
    inputs = originals + paraphrases + unrelated + same_text
    n = len(originals)
    print(f"{n} sentences from {len(pool)}, pooling {args.pooling}; e.g.")
    print(f"  {originals[0]!r}\n  {paraphrases[0]!r}")

    vectors: dict[str, np.ndarray] = {}
    rates: dict[str, list[float]] = {name: [] for name, _ in servers}
    clients = {name: httpx.Client(base_url=url, timeout=600) for name, url in servers}
    for c in clients.values():  # a warm-up request each
        embed(c, inputs[: args.batch], args.pooling, args.batch)
    for rnd in range(args.rounds):
        order = servers if rnd % 2 == 0 else servers[::-1]
        for name, _ in order:
            t0 = time.perf_counter()
            vectors[name] = embed(clients[name], inputs, args.pooling, args.batch)
            rates[name].append(len(inputs) / (time.perf_counter() - t0))

    alone = {name: embed(c, inputs[: args.alone], args.pooling, 1) for name, c in clients.items()}

    first = servers[0][0]
    print(f"{'server':<14}{'vs unrelated':>14}{'vs same text':>14}{'recall@1':>10}"
          f"{'inputs/s':>16}{'cos vs ' + first:>24}")  # fmt: skip
    for name, _ in servers:
        v = vectors[name]
        o, p, u, s = v[:n], v[n : 2 * n], v[2 * n : 3 * n], v[3 * n :]
        pair = (o * p).sum(axis=1)
        vs_unrelated = float(np.mean(pair > (o * u).sum(axis=1)))
        vs_same = float(np.mean(pair > (o * s).sum(axis=1)))
        recall = float(np.mean((o @ p.T).argmax(axis=1) == np.arange(n)))
        cos = (v * vectors[first]).sum(axis=1)
        agree = "-" if name == first else f"min {cos.min():.4f} med {np.median(cos):.4f}"
        rate = "/".join(f"{r:.1f}" for r in rates[name])
        print(f"{name:<14}{vs_unrelated:>14.3f}{vs_same:>14.3f}{recall:>10.3f}"
              f"{rate:>16}{agree:>24}")  # fmt: skip
    print(f"the first {args.alone} inputs sent one a request (cosine, min / median):")
    for name, _ in servers:
        own = (alone[name] * vectors[name][: args.alone]).sum(axis=1)
        line = f"  {name:<14} alone vs in its batch {own.min():.6f} / {np.median(own):.6f}"
        if name != first:
            cos = (alone[name] * alone[first]).sum(axis=1)
            line += f"; alone vs {first} alone {cos.min():.6f} / {np.median(cos):.6f}"
        print(line)
    if len(servers) > 1:
        for name, _ in servers[1:]:
            ratio = statistics.median(rates[first]) / statistics.median(rates[name])
            print(f"{first} / {name} inputs/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
