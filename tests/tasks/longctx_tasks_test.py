#!/usr/bin/env python3
"""Tests of the long-context task generator (evals/longctx_tasks.py).

Run by ctest (longctx_tasks_generator) as
  python3 tests/tasks/longctx_tasks_test.py REPO_ROOT
Needs the python sentencepiece module (scripts/install-deps.sh installs it).
"""
import os
import re
import sys
import unittest

ROOT = sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "evals"))
# The var_track probes (var_track_layout.py, var_track_attention.py) are training tools.
sys.path.insert(0, os.path.join(ROOT, "training"))
import longctx_tasks as lt  # noqa: E402

TOK = os.path.join(ROOT, "models", "ctxcache-ref", "tokenizer.model")
DOCS = lt.EVAL_DOCS  # the held-out evaluation documents (tests/data/demo)


class GeneratorTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tok = lt.Tokenizer(TOK)
        cls.pool = lt.DocumentPool(lt.read_docs(DOCS), cls.tok)

    def tasks(self, seed, lengths=(4096,), depths=(0.1, 0.9)):
        return list(lt.generate(self.pool, self.tok, lt.FAMILIES, lengths, depths, 1, seed))

    def test_every_family_fits_its_length_and_holds_its_answer(self):
        for t in self.tasks(lt.EVAL_SEED, lengths=(4096, 8192)):
            with self.subTest(family=t.family, length=t.length, depth=t.depth):
                total = t.n_tokens + len(t.question_ids) + len(t.answer_ids)
                self.assertLessEqual(total, t.length)
                self.assertGreaterEqual(total, 0.9 * t.length)
                self.assertEqual(t.n_tokens, 1 + len(self.tok.encode(t.context)))
                self.assertEqual(t.question_ids + t.answer_ids,
                                 self.tok.encode(t.question + t.answer))
                self.assertGreater(len(t.answer_ids), 0)
                # The answer is in the context (var_track: the chain's value).
                self.assertIn(lt.final_value(t.answer) if t.family == "var_track"
                              else t.answer.strip(), t.context)
                # The queried needle sits near the requested depth (paragraph
                # granularity; kv_table's depth is the table's first line).
                self.assertLess(abs(t.needle_token / t.n_tokens - t.depth), 0.15)

    def test_the_answer_is_not_in_the_question(self):
        for t in self.tasks(lt.EVAL_SEED):
            self.assertNotIn(t.answer.strip(), t.question)

    def test_same_seed_same_tasks_other_seed_other_tasks(self):
        a = [t.to_json() for t in self.tasks(5)]
        b = [t.to_json() for t in self.tasks(5)]
        c = [t.to_json() for t in self.tasks(6)]
        self.assertEqual(a, b)
        self.assertTrue(all(x["context"] != y["context"] for x, y in zip(a, c)))

    def test_var_track_needs_the_whole_chain(self):
        t = lt.make_task(self.pool, self.tok, "var_track", 4096, 0.2, lt.EVAL_SEED)
        target = t.question.split("VAR ")[-1].split(" =")[0]
        # Follow the chain backwards through the context.
        name, hops = target, 0
        while True:
            line = next(s for s in t.context.split("\n") if s.startswith(f"VAR {name} = "))
            rhs = line.split(" = ", 1)[1].rstrip(".")
            if not rhs.startswith("VAR "):
                break
            name, hops = rhs[4:], hops + 1
        self.assertEqual(hops, 3)
        self.assertEqual(rhs, lt.final_value(t.answer))

    def test_extra_questions_ask_other_needles_and_fit(self):
        want = {"niah_single": 0, "niah_multi": 3, "kv_table": 4, "var_track": 4,
                "section_copy": 4}
        for fam in lt.FAMILIES:
            with self.subTest(family=fam):
                plain = lt.make_task(self.pool, self.tok, fam, 4096, 0.3, 11)
                again = lt.make_task(self.pool, self.tok, fam, 4096, 0.3, 11, extra_questions=0)
                self.assertEqual(plain.to_json(), again.to_json())
                t = lt.make_task(self.pool, self.tok, fam, 4096, 0.3, 11, extra_questions=4)
                ids, spans = t.training_ids()
                self.assertEqual(len(spans), 1 + want[fam])
                self.assertLessEqual(len(ids), 4096)
                self.assertGreaterEqual(len(ids), 0.9 * 4096)
                self.assertEqual(ids[:len(t.token_ids())], t.token_ids())
                self.assertEqual(spans[0], (len(t.token_ids()) - len(t.answer_ids),
                                            len(t.answer_ids)))
                answers = set()
                for s, n in spans[1:]:
                    text = self.tok.sp.decode(ids[s:s + n]).strip()
                    # an answer the context holds (var_track: the value it walks to)
                    self.assertIn(lt.final_value(text) if fam == "var_track" else text,
                                  t.context)
                    q = self.tok.sp.decode(ids[s - 60:s])
                    self.assertIn("Answer:", q)
                    answers.add((self.tok.sp.decode(ids[s - 60:s]), text))
                self.assertEqual(len(answers), want[fam])  # distinct questions

    def test_no_distractor_questions_asks_only_the_queried_chain(self):
        answers = {True: set(), False: set()}
        for seed in range(3):
            for distractors in (True, False):
                t = lt.make_task(self.pool, self.tok, "var_track", 4096, 0.3, 20 + seed,
                                 extra_questions=7, distractor_questions=distractors)
                ids, spans = t.training_ids()
                extra = [self.tok.sp.decode(ids[s:s + n]).strip() for s, n in spans[1:]]
                # all 7 others (3 chain links + 4 distractor links), or the 3 links only
                self.assertEqual(len(extra), 7 if distractors else 3)
                answers[distractors].update(lt.final_value(a) != lt.final_value(t.answer)
                                            for a in extra)
        self.assertEqual(answers[False], {False})  # every answer is the queried value
        self.assertEqual(answers[True], {False, True})
        # The peers of the other families are not distractors: unchanged.
        for fam in ("niah_multi", "kv_table", "section_copy"):
            a = lt.make_task(self.pool, self.tok, fam, 4096, 0.3, 11, extra_questions=4)
            b = lt.make_task(self.pool, self.tok, fam, 4096, 0.3, 11, extra_questions=4,
                             distractor_questions=False)
            self.assertEqual(a.training_ids(), b.training_ids())

    def test_evaluation_var_track_tasks_are_unchanged(self):
        # Every model since v2 is scored on the same held-out tasks (EVAL_SEED),
        # so the generator's draws must not move: these digests of var_track
        # tasks (and a training task's extra questions) were taken before the
        # training-only chain-shape options existed (the value format,
        # v2-v2.2's) and when the chain format became the default (v2.3).
        import hashlib
        import json
        for fmt, want in (("value", "f630b88f1801f92a824efc42d153a095cffa34af"),
                          (None, "b9b8fd4aaf7f10fbd97243989fb9eea1bf987109")):
            kw = {"var_answer": fmt} if fmt else {}
            h = hashlib.sha1()
            for t in lt.generate(self.pool, self.tok, ["var_track"], [2048, 4096],
                                 [0.05, 0.5, 0.95], 2, lt.EVAL_SEED, **kw):
                row = dict(t.to_json(), doc=os.path.basename(t.doc))  # not the path's spelling
                h.update(json.dumps(row, sort_keys=True).encode())
                h.update(json.dumps(t.training_ids()).encode())
            t = lt.make_task(self.pool, self.tok, "var_track", 4096, 0.3, 21, extra_questions=7,
                             **kw)
            h.update(json.dumps(t.training_ids()).encode())
            self.assertEqual(h.hexdigest(), want, fmt)

    def test_var_track_chain_shape_options(self):
        # Training-only options: longer chains and more distractor chains.
        for links, chains in ((6, 2), (3, 0)):
            with self.subTest(links=links, chains=chains):
                t = lt.make_task(self.pool, self.tok, "var_track", 4096, 0.3, 21,
                                 extra_questions=40, var_links=links,
                                 var_distractor_chains=chains)
                lines = [s for s in t.context.split("\n") if s.startswith("VAR ")]
                self.assertEqual(len(lines), links * (1 + chains))
                literal = [s.split(" = ")[1].rstrip(".") for s in lines
                           if not s.split(" = ")[1].startswith("VAR ")]
                self.assertEqual(len(literal), 1 + chains)  # one head per chain
                self.assertEqual(len(set(literal)), 1 + chains)  # distinct values
                target = t.question.split("VAR ")[-1].split(" =")[0]
                name, hops = target, 0
                while True:
                    line = next(s for s in lines if s.startswith(f"VAR {name} = "))
                    rhs = line.split(" = ", 1)[1].rstrip(".")
                    if not rhs.startswith("VAR "):
                        break
                    name, hops = rhs[4:], hops + 1
                self.assertEqual(hops, links - 1)
                self.assertEqual(rhs, lt.final_value(t.answer))
                ids, spans = t.training_ids()
                extra = [lt.final_value(self.tok.sp.decode(ids[s:s + n])) for s, n in spans[1:]]
                # every other variable is asked: the chain's earlier links and
                # each distractor chain's links, with that chain's value
                self.assertEqual(len(extra), links - 1 + links * chains)
                self.assertEqual(extra.count(lt.final_value(t.answer)), links - 1)
                self.assertEqual(set(extra), set(literal))
        with self.assertRaises(ValueError):
            lt.make_task(self.pool, self.tok, "var_track", 4096, 0.3, 21, var_links=1)
        with self.assertRaises(ValueError):
            lt.make_task(self.pool, self.tok, "var_track", 4096, 0.3, 21, var_distractor_late=1.5)

    def test_var_answer_chain_walks_back_to_the_value(self):
        # The chain format answers with every link between the asked variable
        # and the value, as the context states them. Both formats draw the same
        # task: the same chains at the same places and the same question (the
        # haystack's tail may be trimmed further for the longer answers).
        for seed, late in ((21, 0.0), (22, 1.0)):
            with self.subTest(seed=seed):
                kw = dict(extra_questions=40, var_distractor_chains=2, var_distractor_late=late)
                v = lt.make_task(self.pool, self.tok, "var_track", 4096, 0.3, seed,
                                 var_answer="value", **kw)
                c = lt.make_task(self.pool, self.tok, "var_track", 4096, 0.3, seed,
                                 var_answer="chain", **kw)
                self.assertEqual((c.question, c.id, c.needle_token),
                                 (v.question, v.id, v.needle_token))

                def lines(t):
                    return [s for s in t.context.split("\n") if s.startswith("VAR ")]
                self.assertEqual(lines(c), lines(v))
                assign = dict(s[4:].rstrip(".").split(" = ", 1) for s in lines(c))
                ids, spans = c.training_ids()
                v_ids, v_spans = v.training_ids()
                self.assertEqual(len(spans), len(v_spans))
                for (s0, n), (vs, vn) in zip(spans, v_spans):
                    q = self.tok.sp.decode(ids[:s0]).rsplit("value of VAR ", 1)[1]
                    name = q.split("?")[0]
                    walk, want = self.tok.sp.decode(ids[s0:s0 + n]).strip(), []
                    while assign[name].startswith("VAR "):
                        name = assign[name][4:]
                        want.append(f"VAR {name} =")
                    self.assertEqual(walk, " ".join(want + [assign[name]]))
                    self.assertEqual(self.tok.sp.decode(v_ids[vs:vs + vn]).strip(), assign[name])
                self.assertEqual(c.answer.count("VAR "), 3)
        with self.assertRaisesRegex(ValueError, "var_answer must be one of value, chain"):
            lt.make_task(self.pool, self.tok, "var_track", 4096, 0.3, 21, var_answer="both")

    def test_var_distractor_late_puts_the_other_chain_after_the_value(self):
        import var_track_layout as vl
        late = {0.0: 0, 1.0: 0}
        for p in late:
            for seed in range(6):
                t = lt.make_task(self.pool, self.tok, "var_track", 2048, 0.2, 30 + seed,
                                 var_distractor_late=p)
                lay = vl.layout(t)
                late[p] += lay["distractor_head_after"]
                if p == 1.0:  # the whole other chain, not only its value line
                    lines = {m.group(1): (m.start(), m.group(2))
                             for m in vl.LINE.finditer(t.context)}
                    chain = [re.search(r"value of VAR (\w+)", t.question).group(1)]
                    while lines[chain[-1]][1].startswith("VAR "):
                        chain.append(lines[chain[-1]][1][4:])
                    value_at = lines[chain[-1]][0]
                    others = [at for name, (at, _) in lines.items() if name not in chain]
                    self.assertEqual(len(others), 4)
                    self.assertGreater(min(others), value_at)
        self.assertEqual(late[1.0], 6)
        self.assertLess(late[0.0], 6)  # at depth 0.2, uniform placement is often before

    def test_var_track_layout_groups_accuracy_by_chain_layout(self):
        import var_track_layout as vl
        tasks = list(lt.generate(self.pool, self.tok, ["var_track"], [2048],
                                 [0.05, 0.25, 0.5, 0.75, 0.95], 2, lt.EVAL_SEED))
        for t in tasks:
            lay = vl.layout(t)
            pos = {m.group(1): m.start() for m in vl.LINE.finditer(t.context)}
            value_line = t.context.index(f"= {lt.final_value(t.answer)}.")
            heads = [m.start() for m in vl.LINE.finditer(t.context)
                     if not m.group(2).startswith("VAR ")]
            self.assertEqual(len(pos), 8)
            self.assertEqual(lay["distractor_head_after"], max(heads) > value_line)
            self.assertTrue(0 <= lay["distractor_links_inside"] <= 4)
            self.assertTrue(0 <= lay["chain_span"] <= 1)
        # Correct exactly when the distractor's value comes first: the groups
        # show it; a second model that is always right halves the wrong group.
        rule = {t.id: not vl.layout(t)["distractor_head_after"] for t in tasks}
        by = vl.by_layout(tasks, [rule])
        self.assertEqual(by["distractor_head_after"]["False"][0], 1.0)
        self.assertEqual(by["distractor_head_after"]["True"][0], 0.0)
        self.assertEqual(sum(n for _, n in by["length"].values()), len(tasks))
        self.assertEqual(by["length_and_after"], {"2048/False": [1.0, 8], "2048/True": [0.0, 2]})
        both = vl.by_layout(tasks, [rule, {t.id: True for t in tasks}])
        self.assertEqual(both["distractor_head_after"]["True"][0], 0.5)  # 2 of these 10
        # A task the results lack is left out, not counted as a miss.
        some = vl.by_layout(tasks, [dict(list(rule.items())[1:])])
        self.assertEqual(sum(n for _, n in some["length"].values()), len(tasks) - 1)
        # From an eval file's rows (any order, other families beside): the same
        # tasks are regenerated, and the summary is the rule's groups.
        rows = [{"id": t.id, "family": t.family, "length": t.length, "depth": t.depth,
                 "correct": rule[t.id]} for t in reversed(tasks)]
        rows.append({"id": "x", "family": "kv_table", "length": 8192, "depth": 0.6,
                     "correct": False})
        self.assertEqual([t.id for t in vl.eval_tasks(rows, self.tok, self.pool)],
                         [t.id for t in tasks])
        self.assertEqual(vl.eval_summary(rows), {"False": [1.0, 8], "True": [0.0, 2]})

    def test_var_track_attention_spans_roles_and_rows(self):
        try:
            import torch
        except ImportError:
            self.skipTest("no torch")
        import llama
        import var_track_attention as va
        t = lt.make_task(self.pool, self.tok, "var_track", 2048, 0.3, 21, var_answer="value")
        ids = [lt.BOS] + t.context_ids
        spans = va.line_spans(t, self.tok)
        self.assertEqual(len(spans), 8)
        for name, (a, b, rhs) in spans.items():  # each span is its line's tokens
            line = f"VAR {name} = {rhs}."
            end = t.context.index(line) + len(line)
            self.assertEqual(ids[a:b], self.tok.encode(t.context[:end])[a - 1:])
            # (after "\n\n" the first word has no leading-space piece)
            self.assertEqual(ids[a + 1:b], self.tok.encode(line)[1:])
        groups, chain, other = va.roles(t, spans)
        self.assertEqual(sorted(groups), ["hop0", "hop1", "hop2", "hop3", "other_links",
                                          "other_value"])
        self.assertEqual(len(groups["other_links"]), 3)
        self.assertEqual(spans[chain[-1]][2], lt.final_value(t.answer))
        self.assertIn(f"VAR {chain[0]}?", t.question)
        # The rows are the last query's attention: distributions over the whole
        # prefix that, applied to the values, give the layer's attention output.
        torch.manual_seed(0)
        m = llama.Llama(llama.Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
        full = ids + t.question_ids
        rows, logits = va.last_row_attention(m, full)
        self.assertEqual(len(rows), 2)
        for p in rows:
            self.assertEqual(tuple(p.shape), (4, len(full)))
            torch.testing.assert_close(p.sum(-1), torch.ones(4))
        with torch.no_grad():
            x = m.model.embed_tokens(torch.tensor([full]))
            cos, sin = m.rope(len(full), "cpu")
            att = m.model.layers[0].self_attn
            h = m.model.layers[0].input_layernorm(x)
            _, _, v = att.qkv(h, cos, sin)
            o = torch.einsum("ht,htd->hd", rows[0], v[0])[None, :, None]
            torch.testing.assert_close(att.out(o)[0, 0], att(h, cos, sin)[0, -1],
                                       atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(logits, m(torch.tensor([full]))[0, -1],
                                       atol=1e-4, rtol=1e-4)
        rec = va.task_record(m, self.tok, t)
        self.assertEqual(len(rec["layers"]), 2)
        for layer in rec["layers"]:
            self.assertEqual(set(layer), set(groups))
            self.assertTrue(all(0.0 <= v <= 1.0 + 1e-6 for v in layer.values()))
        self.assertEqual([rhs for n, (_, _, rhs) in spans.items()
                          if n not in chain and not rhs.startswith("VAR ")], [other])
        oth = lt._qa_ids(self.tok, t.question, " " + other)[1]
        k = rec["deciding_token"]  # the first token where the two values part
        self.assertGreaterEqual(k, 1)  # the leading space piece is shared
        self.assertEqual(t.answer_ids[:k], oth[:k])
        self.assertNotEqual(t.answer_ids[k], oth[k])
        flipped = dict(rec, right=not rec["right"], other=False)
        s = va.summarize([rec, flipped])
        self.assertEqual((s["n"], s["right"]), (2, 1))
        self.assertEqual(s["by"]["right"]["n"] + s["by"]["wrong"]["n"], 2)
        self.assertEqual(s["by"]["right"]["layers"]["0"], {g: round(v, 3) for g, v in
                                                           rec["layers"][0].items()})

    def test_tasks_do_not_depend_on_the_hash_seed(self):
        # section_copy once ordered a set of str: its tasks changed with
        # PYTHONHASHSEED, i.e. from one process to the next.
        import subprocess
        outs = []
        for hs in ("1", "2"):
            code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import longctx_tasks as lt;"
                    "tok = lt.Tokenizer(sys.argv[2]); pool = lt.DocumentPool(lt.read_docs("
                    "sys.argv[3:]), tok); print(json.dumps([t.to_json() for t in lt.generate("
                    "pool, tok, lt.FAMILIES, [2048], [0.2, 0.8], 2, lt.EVAL_SEED)]))")
            r = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "evals"),
                                TOK] + DOCS, env=dict(os.environ, PYTHONHASHSEED=hs),
                               stdout=subprocess.PIPE, check=True, text=True)
            outs.append(r.stdout)
        self.assertEqual(outs[0], outs[1])

    def test_unknown_family_is_an_error(self):
        with self.assertRaisesRegex(ValueError, "unknown family"):
            lt.make_task(self.pool, self.tok, "nope", 4096, 0.5, 1)


if __name__ == "__main__":
    unittest.main(verbosity=1)
