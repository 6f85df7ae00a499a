#!/usr/bin/env python3
"""Synthetic long-context retrieval tasks placed inside real documents (issue 17).

One generator serves both sides: training/train.py mixes its tasks into the
training data of the reference model, and `ctxcache-bench tasks` scores the
held-out tasks through ctxcached. Only the standard library and the python
sentencepiece module (for exact token lengths) are needed.

Task families (RULER-style, each a retrieval the model cannot guess from local
context):
  niah_single  one needle "The special magic {kind} for {key} is {value}." at the
               needle depth; kind is a number, a word or a UUID-like code.
  niah_multi   four needles with distinct keys (one per depth band, the queried
               one at the needle depth) plus two of the same kind for other keys.
  kv_table     a JSON-like table of 24 UUID-like key/value pairs at the needle
               depth; the question names one key.
  var_track    a chain of 4 assignments (VAR A = 48213, VAR B = VAR A, ...), its
               first link at the needle depth and the rest spread towards the end,
               plus one distractor chain with another value. The question asks
               the last variable's value; the answer is the value itself
               (var_answer "value": three hops inside one forward pass) or the
               chain walked back to it, " VAR C = VAR B = VAR A = 48213"
               (var_answer "chain": one link per answer step, as RULER's
               variable tracking answers with the chain's variables).
  section_copy six "Section X.Y (on TOPIC)." notes, each a sentence copied from a
               far-away document; the queried one sits at the needle depth and the
               answer is its whole sentence (a 6-24 token span).

A task is the haystack (paragraphs of real text, consecutive from a random
starting paragraph of the document pool, wrapping into the next document) with
the inserted needles on paragraph boundaries, then a question that ends where
the answer starts. Depth is the queried needle's position as a fraction of the
context tokens (0 = first token, 1 = just before the question): a small depth is
a far needle. Lengths are tokens of [<s>] + context + question + answer, at most
the target length and within 10% below it.

Token ids: context_ids are encode(context); question_ids are encode(question);
answer_ids are encode(question + answer) minus the question's ids. Sentencepiece
never merges across a space, so question_ids + answer_ids == encode(question +
answer) (checked). A scorer compares the first len(answer_ids) generated tokens.

Seeds: each task's RNG is seeded from (seed, length, depth index, family, index),
so tasks are reproducible one by one. EVAL_SEED is the held-out evaluation seed;
training seeds must differ from it (train.py refuses it) and the evaluation reads
held-out documents only (tests/data/demo, never the training corpus).

Why Python, and a file between the two sides: the training code is Python
(train.py imports this module), and the service-side evaluation is the C++
`ctxcache-bench tasks`, which already runs the real model through ctxcached
with the reference worker (client::GenerateRemote) and needs neither torch nor
transformers on the CPU machine. The JSONL carries the question and answer
token ids, so the bench needs no tokenizer; it checks the server's token count
of the context against the generator's n_tokens.

Usage:
  python3 evals/longctx_tasks.py --tok models/ctxcache-ref/tokenizer.model \\
      --docs tests/data/demo/vim_help.txt,tests/data/demo/r_admin.txt \\
      --lengths 4096,8192 --depths 0.1,0.5,0.9 --per-cell 2 --out tasks.jsonl
Writes one JSON object per line (fields: see Task.to_json).
"""
import argparse
import hashlib
import json
import os
import random
import re
import sys

FAMILIES = ("niah_single", "niah_multi", "kv_table", "var_track", "section_copy")
EVAL_SEED = 917_000_017  # held-out evaluation seed; never used for training
# The held-out evaluation documents (train.py eval's tasks; never training text).
EVAL_DOCS = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                          "data", "demo", n + ".txt")
             for n in ("vim_help", "r_admin", "linux_firmware_guide", "document")]
BOS = 1
# var_track's answer formats (see the module docstring); VAR_ANSWER is the one
# the shipped model was trained on (v2.3 on; v2-v2.2: "value"), and the
# default everywhere.
VAR_ANSWERS = ("value", "chain")
VAR_ANSWER = "chain"

WORDS = (
    "amber anchor apple arrow aspen badge bamboo banner barley basin beacon berry birch "
    "blossom bolt bramble breeze brick bridge bronze cabin cactus canal candle canyon "
    "carbon cedar cellar chalk cherry cinder citrus clover cobalt comet copper coral "
    "cotton crane crater cricket crystal cypress dagger delta desert dolphin dragon "
    "drift dune eagle ember emerald falcon fern fiddle flint forest fossil fountain "
    "garnet geyser ginger glacier granite gravel harbor harvest hazel heron hollow "
    "honey horizon iris ivory jasmine jungle juniper kettle lagoon lantern lava lemon "
    "lichen lilac linen lotus magnet mango maple marble meadow mercury mesa meteor "
    "mint mirror monsoon mosaic moss nectar nickel oasis ocean olive onyx orbit orchid "
    "otter oyster paddle panther pebble pepper pigeon pine planet plume poplar prairie "
    "prism quartz quiver rabbit raven reef ribbon river rocket saffron salmon sapphire "
    "satin scarlet shadow shell sierra silver slate sparrow spruce summit tango thistle "
    "thunder tiger timber topaz tulip tundra velvet violet walnut willow winter yarrow "
    "zephyr").split()
ADJECTIVES = (
    "quiet bright hidden silent golden rapid gentle frozen distant hollow crimson "
    "ancient lucky narrow patient proud rusty shy steady swift tidy wild wise young "
    "brave calm clever eager fancy jolly kind lively lonely mighty noble odd plain "
    "rare sharp smooth sober sunny tall tender vivid warm").split()
KINDS = ("number", "word", "code")


def _value(rng, kind):
    if kind == "number":
        return str(rng.randrange(1_000_000, 10_000_000))
    if kind == "word":
        return rng.choice(WORDS)
    return _code(rng)


def _code(rng):
    h = "".join(rng.choice("0123456789abcdef") for _ in range(12))
    return f"{h[:8]}-{h[8:]}"


def _key(rng, used):
    while True:
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(WORDS)}"
        if k not in used:
            used.add(k)
            return k


def _varname(rng, used):
    while True:
        v = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5))
        if v not in used:
            used.add(v)
            return v


class Tokenizer:
    """sentencepiece with the reference model's settings (no <s> added here)."""

    def __init__(self, model_file):
        import sentencepiece as spm
        self.sp = spm.SentencePieceProcessor(model_file=model_file)

    def encode(self, text):
        return self.sp.encode(text)

    def count(self, text):
        return len(self.sp.encode(text))

    def newlines(self, n):
        """n newline tokens: what the "\n\n" closing a context encodes to."""
        nl = self.sp.piece_to_id("<0x0A>")
        if nl == self.sp.unk_id():
            raise ValueError("tokenizer has no <0x0A> byte piece")
        return [nl] * n


class DocumentPool:
    """Paragraphs of real documents in order, with their token counts.

    docs: list of (name, text). Paragraphs are the text split on blank lines;
    a paragraph longer than max_para_tokens is split on lines so insertion
    points stay dense."""

    def __init__(self, docs, tok, max_para_tokens=400):
        self.paras = []  # (doc index, text, tokens)
        self.names = [n for n, _ in docs]
        for di, (_, text) in enumerate(docs):
            for p in re.split(r"\n\s*\n", text):
                p = p.strip("\n")
                if not p.strip():
                    continue
                n = tok.count(p)
                if n <= max_para_tokens:
                    self.paras.append((di, p, n))
                    continue
                chunk, cn = [], 0
                for line in p.split("\n"):
                    ln = tok.count(line) + 1
                    if chunk and cn + ln > max_para_tokens:
                        self.paras.append((di, "\n".join(chunk), cn))
                        chunk, cn = [], 0
                    chunk.append(line)
                    cn += ln
                if chunk:
                    self.paras.append((di, "\n".join(chunk), cn))
        if not self.paras:
            raise ValueError("document pool is empty")
        # Sentences of 6..24 words, for section_copy spans.
        self.sentences = []
        for di, p, _ in self.paras:
            for s in re.split(r"(?<=[.!?])\s+", p.replace("\n", " ")):
                s = " ".join(s.split())
                w = s.split()
                if 6 <= len(w) <= 24 and s[-1:] == "." \
                        and re.fullmatch(r"[A-Za-z0-9 ,.;:'()\-]+", s):
                    self.sentences.append((di, s))

    def haystack(self, rng, n_tokens):
        """Consecutive paragraphs (doc index, text, tokens) from a random start
        (wrapping) with at least n_tokens tokens (plus 2 per separator)."""
        i = rng.randrange(len(self.paras))
        out, total = [], 0
        for _ in range(len(self.paras)):
            di, p, n = self.paras[i]
            out.append((di, p, n))
            total += n + 2
            if total >= n_tokens:
                break
            i = (i + 1) % len(self.paras)
        return out


class Task:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def token_ids(self):
        """[<s>] + context + question + answer (no </s>, no extra questions)."""
        return [BOS] + self.context_ids + self.question_ids + self.answer_ids

    def training_ids(self):
        """(ids, spans): token_ids() followed by the extra questions and their
        answers, and the (start, length) in ids of every answer, the queried
        one first."""
        ids = self.token_ids()
        spans = [(len(ids) - len(self.answer_ids), len(self.answer_ids))]
        for q_ids, a_ids in self.extra:
            ids = ids + q_ids
            spans.append((len(ids), len(a_ids)))
            ids = ids + a_ids
        return ids, spans

    def to_json(self):
        return {k: self.__dict__[k] for k in (
            "id", "family", "seed", "length", "depth", "kind", "n_tokens", "needle_token",
            "doc", "context", "question", "answer", "question_ids", "answer_ids")}


def _needles(family, rng, pool, haystack_docs, var_links=4, var_distractor_chains=1,
             var_late=(0.0, 0.0), var_answer=VAR_ANSWER):
    """Returns (inserts, question, answer, kind, others): inserts is a list of
    (relative position in [0, 1] or None for 'at the depth', text); others
    lists (question, answer, is_distractor) for the task's other needles, in
    the queried one's format (the extra questions of training rows; listing
    them draws nothing from rng, so a task without extra questions is
    unchanged). is_distractor marks a needle planted to be confused with the
    queried one (var_track's other chains); the rest are its peers.
    var_track has var_links links per chain and var_distractor_chains other
    chains; var_late = (p, depth): with probability p an other chain's lines
    all come after the queried value's depth (nearer the question). The
    defaults (4, 1, p 0) are the evaluation's format, and draw exactly what
    they drew before these options existed. var_answer (VAR_ANSWERS) changes
    only var_track's answer texts, never what is drawn."""
    used = set()
    if family in ("niah_single", "niah_multi"):
        kind = rng.choice(KINDS)

        def qa(key, value):
            return (f"Question: What is the special magic {kind} for {key} mentioned in the "
                    f"text above?\nAnswer: The special magic {kind} for {key} is", f" {value}")
        key = _key(rng, used)
        value = _value(rng, kind)
        inserts = [(None, f"The special magic {kind} for {key} is {value}.")]
        others = []
        if family == "niah_multi":
            for band in range(3):
                u = rng.uniform(band / 3, (band + 1) / 3)  # draws in the original order
                k, v = _key(rng, used), _value(rng, kind)
                inserts.append((u, f"The special magic {kind} for {k} is {v}."))
                others.append(qa(k, v) + (False,))
        return (inserts,) + qa(key, value) + (kind, others)
    if family == "kv_table":
        keys = [_code(rng) for _ in range(24)]
        vals = [_code(rng) for _ in range(24)]
        qi = rng.randrange(len(keys))
        body = ",\n".join(f'  "{k}": "{v}"' for k, v in zip(keys, vals))
        table = "JSON data:\n{\n" + body + "\n}"

        def qa(i):
            return (f'Question: In the JSON data above, what is the value of the key '
                    f'"{keys[i]}"?\nAnswer: "{keys[i]}": "', vals[i])
        others = [qa(i) + (False,) for i in range(len(keys)) if i != qi]
        return ([(None, table)],) + qa(qi) + ("code", others)
    if family == "var_track":
        names = [_varname(rng, used) for _ in range(var_links * (1 + var_distractor_chains))]
        value = str(rng.randrange(10_000, 100_000))
        other = str(rng.randrange(10_000, 100_000))
        chain = names[:var_links]
        inserts = [(None, f"VAR {chain[0]} = {value}.")]
        pos = sorted(rng.uniform(0, 1) for _ in range(var_links - 1))
        for j in range(1, var_links):
            inserts.append((("after", pos[j - 1]), f"VAR {chain[j]} = VAR {chain[j - 1]}."))

        def qa(back, v):
            # back: the asked variable, then each one it was assigned from.
            walk = "".join(f" VAR {n} =" for n in back[1:]) if var_answer == "chain" else ""
            return (f"Question: Following the VAR assignments in the text above, what is the "
                    f"value of VAR {back[0]}?\nAnswer: VAR {back[0]} =", f"{walk} {v}")
        others = [qa(chain[j::-1], value) + (False,) for j in range(var_links - 1)]
        values = {value}
        for c in range(var_distractor_chains):
            dist = names[var_links * (1 + c):var_links * (2 + c)]
            v = other
            while c > 0 and v in values:  # later chains draw their own, distinct value
                v = str(rng.randrange(10_000, 100_000))
            values.add(v)
            lo = var_late[1] if var_late[0] > 0 and rng.random() < var_late[0] else 0.0
            dpos = sorted(rng.uniform(lo, 1) for _ in range(var_links))
            inserts.append((dpos[0], f"VAR {dist[0]} = {v}."))
            for j in range(1, var_links):
                inserts.append((dpos[j], f"VAR {dist[j]} = VAR {dist[j - 1]}."))
            others += [qa(dist[j::-1], v) + (True,) for j in range(var_links)]
        return (inserts,) + qa(chain[::-1], value) + ("number", others)
    if family == "section_copy":
        far = [s for s in pool.sentences if s[0] not in haystack_docs] or pool.sentences
        picks = rng.sample(far, 6)
        topics = rng.sample(WORDS, 6)
        codes = set()
        while len(codes) < 6:
            codes.add(f"{rng.randrange(2, 20)}.{rng.randrange(1, 10)}")
        # sorted() first: a set of str iterates in an order that changes with
        # PYTHONHASHSEED, which made these tasks differ from process to process.
        codes = sorted(sorted(codes), key=lambda c: rng.random())
        inserts = [(None, f"Section {codes[0]} (on {topics[0]}). {picks[0][1]}")]
        for j in range(1, 6):
            inserts.append((rng.uniform(0, 1), f"Section {codes[j]} (on {topics[j]}). "
                            f"{picks[j][1]}"))

        def qa(j):
            return (f"Question: What did section {codes[j]} say about {topics[j]}? Quote it.\n"
                    f"Answer: Section {codes[j]} (on {topics[j]}).", f" {picks[j][1]}")
        return (inserts,) + qa(0) + ("span", [qa(j) + (False,) for j in range(1, 6)])
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def final_value(answer):
    """The literal a var_track answer ends with, in either format (VAR_ANSWERS):
    " 48213" and " VAR C = VAR B = VAR A = 48213" both give "48213"."""
    return answer.rsplit("= ", 1)[-1].strip()


def answer_in_context(text, context):
    """Whether a generated answer restates what the context holds (a wrong
    binding when the answer is wrong) rather than drifting: the text occurs
    verbatim (a value or a copied span), or, for a var_track chain walk
    ("VAR C = VAR B = ... = 48213", VAR_ANSWERS "chain"), each name or value
    it states is the right-hand side of a VAR line of the context (the last
    may be cut short, as a greedy output of the answer's length is)."""
    text = text.strip()
    if not (text.startswith("VAR ") and " = " in text):
        return bool(text) and text in context
    *whole, last = text.split(" = ")
    return all(f"= {p}." in context for p in whole) and f"= {last}" in context


def _task_rng(seed, length, depth_index, family, index):
    h = hashlib.sha256(f"{seed}/{length}/{depth_index}/{family}/{index}".encode()).digest()
    return random.Random(int.from_bytes(h[:8], "little"))


def _qa_ids(tok, question, answer):
    """(question ids, answer ids) with question ids + answer ids ==
    encode(question + answer)."""
    qa_ids = tok.encode(question + answer)
    question_ids = tok.encode(question)
    if qa_ids[:len(question_ids)] != question_ids:
        raise AssertionError(f"question tokens are not a prefix: {question!r}")
    return question_ids, qa_ids[len(question_ids):]


def check_var_shape(links, chains, late, answer=VAR_ANSWER,
                    names=("var_links", "var_distractor_chains", "var_distractor_late",
                           "var_answer")):
    """Raises ValueError naming the first bad one of make_task's var_track
    shape arguments (names: how the caller calls them, e.g. its flags)."""
    if answer not in VAR_ANSWERS:
        raise ValueError(f"{names[3]} must be one of {', '.join(VAR_ANSWERS)}, got {answer!r}")
    if links < 2:
        raise ValueError(f"{names[0]} must be >= 2, got {links}")
    if chains < 0:
        raise ValueError(f"{names[1]} must be >= 0, got {chains}")
    if not 0 <= late <= 1:
        raise ValueError(f"{names[2]} must be in [0, 1], got {late}")


def make_task(pool, tok, family, length, depth, seed, depth_index=0, index=0,
              extra_questions=0, distractor_questions=True, var_links=4,
              var_distractor_chains=1, var_distractor_late=0.0, var_answer=VAR_ANSWER):
    """One task of `family` whose total tokens ([<s>] + context + question +
    answer, plus the extra questions) are in [0.9 * length, length], with the
    queried needle at `depth`.

    extra_questions > 0 (training rows only): up to that many of the task's
    other needles (`_needles`' others, in random order) are asked after the
    answer, each as "\n\n" + question + answer, so that one long context
    trains several retrievals (Task.extra; niah_single has none). With 0 the
    task is exactly the one made without the argument. distractor_questions=False
    leaves the distractor needles out of that choice (var_track then asks only
    the queried chain's earlier links, whose answer is the queried one's).
    var_links (>= 2), var_distractor_chains (>= 0) and var_distractor_late (the
    probability in [0, 1] that an other chain comes after the queried value, all
    of it) shape var_track's chains (training rows only: the task id does not
    record them, and the evaluation uses the defaults, 4, 1 and 0). var_answer
    picks var_track's answer format (VAR_ANSWERS; the task id does not record
    it either: both draw the same chains at the same places, though the longer
    chain answers may trim the haystack's tail further)."""
    check_var_shape(var_links, var_distractor_chains, var_distractor_late, var_answer)
    rng = _task_rng(seed, length, depth_index, family, index)
    budget = length
    for attempt in range(6):
        hay = pool.haystack(rng, budget)
        inserts, question, answer, kind, others = _needles(
            family, rng, pool, {d for d, _, _ in hay}, var_links, var_distractor_chains,
            (var_distractor_late, depth), var_answer)
        extra = []  # (ids of "\n\n" + question, answer ids)
        if not distractor_questions:
            others = [o for o in others if not o[2]]
        if extra_questions > 0 and others:
            for q2, a2, _ in rng.sample(others, min(extra_questions, len(others))):
                q_ids, a_ids = _qa_ids(tok, q2, a2)
                extra.append((tok.newlines(2) + q_ids, a_ids))
        n_extra = sum(len(q) + len(a) for q, a in extra)
        paras = [p for _, p, _ in hay]
        # Place every insert on a paragraph boundary by token position: the
        # queried one (rel None) at the depth, the others at their own relative
        # positions; ("after", u) entries are chain links placed at fraction u of
        # the way from the previous link to the end.
        n = len(paras)
        cum = [0]
        for _, _, n_tok in hay:
            cum.append(cum[-1] + n_tok + 2)

        def slot_at(frac):
            target = frac * cum[-1]
            return min(range(n + 1), key=lambda i: abs(cum[i] - target))

        slots = {}
        qslot = slot_at(depth)
        slots.setdefault(qslot, []).append(inserts[0][1])
        last = qslot
        for rel, text in inserts[1:]:
            if isinstance(rel, tuple):
                s = max(last + 1, slot_at(cum[last] / cum[-1] + rel[1] * (1 - cum[last] / cum[-1])))
                s = min(n, s)
                last = s
            else:
                s = slot_at(rel)
                if s == qslot:
                    s = min(n, s + 1)
            slots.setdefault(s, []).append(text)
        blocks = []
        for i in range(n + 1):
            blocks.extend(slots.get(i, []))
            if i < n:
                blocks.append(paras[i])
        # Trim whole paragraphs from the end (never an insert) until it fits.
        inserted = {t for v in slots.values() for t in v}
        question_ids, answer_ids = _qa_ids(tok, question, answer)
        n_qa = len(question_ids) + len(answer_ids) + n_extra  # tokens after the context
        context = "\n\n".join(blocks) + "\n\n"
        ctx_ids = tok.encode(context)
        counts = {p: n_tok for _, p, n_tok in hay}
        while 1 + len(ctx_ids) + n_qa > length:
            # Drop trailing paragraphs (never an insert) worth the excess, then
            # re-encode once.
            excess = 1 + len(ctx_ids) + n_qa - length
            dropped = False
            while excess > 0:
                drop = next((j for j in range(len(blocks) - 1, -1, -1)
                             if blocks[j] not in inserted), None)
                if drop is None or drop < len(blocks) // 2:
                    break
                excess -= counts.get(blocks[drop], 0) + 2
                blocks.pop(drop)
                dropped = True
            if not dropped:
                break
            context = "\n\n".join(blocks) + "\n\n"
            ctx_ids = tok.encode(context)
        total = 1 + len(ctx_ids) + n_qa
        if 0.9 * length <= total <= length:
            needle = inserts[0][1]
            start = context.index(needle)
            needle_token = 1 + len(tok.encode(context[:start]))
            tid = hashlib.sha1(f"{seed}/{length}/{depth_index}/{family}/{index}".encode())
            return Task(id=tid.hexdigest()[:12], family=family, seed=seed, length=length,
                        depth=depth, kind=kind, n_tokens=1 + len(ctx_ids),
                        needle_token=needle_token, doc=pool.names[hay[0][0]], context=context,
                        question=question, answer=answer, question_ids=question_ids,
                        answer_ids=answer_ids, context_ids=ctx_ids, extra=extra)
        budget = int(budget * (0.95 * length / total))
    raise RuntimeError(f"could not fit a {family} task into {length} tokens")


def generate(pool, tok, families, lengths, depths, per_cell, seed, var_answer=VAR_ANSWER):
    """Every (length, depth, family) cell, per_cell tasks each, in that order."""
    for length in lengths:
        for di, depth in enumerate(depths):
            for family in families:
                for i in range(per_cell):
                    yield make_task(pool, tok, family, length, depth, seed, di, i,
                                    var_answer=var_answer)


def read_docs(paths):
    """Documents from files: a file holding "\\x1e"-separated documents (the
    corpus format of make_corpus.py) gives several, any other file one."""
    docs = []
    for path in paths:
        if path.endswith(".xz"):
            import lzma
            with lzma.open(path, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        parts = [d.strip("\n") for d in text.split("\x1e\n") if d.strip()]
        for i, d in enumerate(parts):
            docs.append((path if len(parts) == 1 else f"{path}#{i}", d))
    return docs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tok", required=True, help="sentencepiece model")
    ap.add_argument("--docs", required=True, help="comma-separated document files")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--depths", default="0.05,0.25,0.5,0.75,0.95")
    ap.add_argument("--per-cell", type=int, default=1)
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--var-answer", default=VAR_ANSWER, choices=VAR_ANSWERS,
                    help="var_track's answer: the value, or the chain walked back to it")
    ap.add_argument("--out", required=True, help="JSONL output ('-' = stdout)")
    a = ap.parse_args(argv)
    families = a.families.split(",")
    for f in families:
        if f not in FAMILIES:
            ap.error(f"--families: unknown family {f!r}; known: {', '.join(FAMILIES)}")
    lengths = [int(x) for x in a.lengths.split(",")]
    depths = [float(x) for x in a.depths.split(",")]
    if any(not 0 <= d <= 1 for d in depths):
        ap.error("--depths: each depth must be in [0, 1]")
    tok = Tokenizer(a.tok)
    pool = DocumentPool(read_docs(a.docs.split(",")), tok)
    out = sys.stdout if a.out == "-" else open(a.out, "w", encoding="utf-8")
    n = 0
    for t in generate(pool, tok, families, lengths, depths, a.per_cell, a.seed, a.var_answer):
        out.write(json.dumps(t.to_json(), ensure_ascii=False) + "\n")
        n += 1
    if out is not sys.stdout:
        out.close()
    print(f"{n} tasks -> {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
