#!/usr/bin/env python3
"""Builds the reference-model corpus from Debian documentation packages.

Runs on the CPU machine with the standard library only (plus `apt-get`,
`dpkg-deb` and `pod2text`). Steps:
  1. `apt-get download` the pinned packages into WORK/debs (skipped if there),
  2. `dpkg-deb -x` them into WORK/x,
  3. convert each source to plain text (Sphinx .rst.txt sources, AsciiDoc .txt,
     POD through pod2text, HTML through html.parser),
  4. group pages of one manual into long documents (in file order, up to
     CAP_CHARS characters; one page longer than that stays whole),
  5. hold out about 2% of the text (deterministic, by md5 of the name): 4 long
     documents (>= 250K chars, so 16K-token evaluation is possible; the
     perluniprops table and source listings are skipped) plus shorter ones up
     to 0.8% of the text,
  6. write WORK/corpus/{train,heldout}.txt (documents separated by a line that
     holds only "\x1e"), WORK/corpus/docs.tsv and model/train/corpus_manifest.txt.

Usage: python3 model/train/make_corpus.py [WORK]   (default model/train/work)
"""
import gzip
import hashlib
import html.parser
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "work")
PACKAGES = [
    ("postgresql-doc-15", "15.20-0+deb12u1"),
    ("python3.11-doc", "3.11.2-6+deb12u9"),
    ("linux-doc-6.1", "6.1.192-2"),
    ("perl-doc", "5.36.0-7+deb12u4"),
    ("git-doc", "1:2.39.5-0+deb12u3"),
    ("debian-reference-en", "2.100"),
    # Second batch: generic handlers (see EXTRA below).
    ("apache2-doc", "2.4.71-1~deb12u1"),
    ("autoconf-doc", "2.71-3"),
    ("bash-doc", "5.2.15-2"),
    ("cmake-doc", "3.25.1-1"),
    ("debian-policy", "4.6.2.0"),
    ("developers-reference", "12.18"),
    ("emacs-common", "1:28.2+1-15+deb12u4"),
    ("erlang-doc", "1:25.2.3+dfsg-1+deb12u4"),
    ("gnuplot-doc", "5.4.4+dfsg1-2"),
    ("maxima-doc", "5.46.0-11"),
    ("nodejs-doc", "18.20.4+dfsg-1~deb12u3"),
    ("octave-doc", "7.3.0-2"),
    ("python-django-doc", "3:3.2.25-0+deb12u7"),
    ("python-scipy-doc", "1.10.1-2"),
    ("r-doc-info", "4.2.2.20221110-2"),
    ("sphinx-doc", "5.3.0-4"),
    ("sqlite3-doc", "3.40.1-2+deb12u2"),
    ("vim-runtime", "2:9.0.1378-2+deb12u2"),
    ("zsh-doc", "5.9-4"),
]
# package -> (handler, subdirectory, file filter regex). Handlers:
#   sphinx: html/_sources/**/*.txt grouped by top-level directory
#   info:   usr/share/info/**.info[-N].gz, one manual per document group
#   html:   *.html grouped by directory (regex filters paths)
#   text:   plain text files matching the regex, grouped by directory
EXTRA = {
    "apache2-doc": ("html", "usr/share/doc/apache2-doc/manual", r"/manual/(?!(da|de|es|fr|ja|ko|pt-br|ru|tr|zh-cn)/)"),
    "autoconf-doc": ("info", "usr/share/info", r""),
    "bash-doc": ("info", "usr/share/info", r""),
    "cmake-doc": ("sphinx", "usr/share/doc/cmake-data/html/_sources", r""),
    "debian-policy": ("sphinx", "usr/share/doc/debian-policy/policy.html/_sources", r""),
    "developers-reference": ("sphinx", "usr/share/developers-reference/_sources", r""),
    "emacs-common": ("info", "usr/share/info", r""),
    "erlang-doc": ("html", "usr/share/doc/erlang-doc", r"^(?!.*/lib/wx-)"),  # not the wx API lists
    "gnuplot-doc": ("info", "usr/share/info", r""),
    "maxima-doc": ("info", "usr/share/info", r""),
    "nodejs-doc": ("text", "usr/share/doc/nodejs/api", r"\.md$"),
    "octave-doc": ("info", "usr/share/info", r""),
    "python-django-doc": ("html", "usr/share/doc/python-django-doc/html", r"(?<!index)\.html$"),
    "python-scipy-doc": ("html", "usr/share/doc/python-scipy-doc/html", r"/(tutorial|dev)/|/reference/[^/]+\.html$"),
    "r-doc-info": ("info", "usr/share/info", r""),
    "sphinx-doc": ("sphinx", "usr/share/doc/sphinx-doc/html/_sources", r""),
    "sqlite3-doc": ("html", "usr/share/doc/sqlite3", r""),
    "vim-runtime": ("text", "usr/share/vim/vim90/doc", r"\.txt$"),
    "zsh-doc": ("info", "usr/share/info", r""),
}
CAP_CHARS = 400_000   # pages of one manual are joined up to this size
SPLIT_CHARS = 1_500_000  # a single page larger than this is split on paragraphs
SEP = "\x1e"
MIN_LONG_HELDOUT = 4
SHORT_FRACTION = 0.008
LONG_CHARS = 250_000


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def fetch():
    debs = os.path.join(WORK, "debs")
    os.makedirs(debs, exist_ok=True)
    have = os.listdir(debs)
    want = [f"{p}={v}" for p, v in PACKAGES if not any(f.startswith(p + "_") for f in have)]
    if want:
        sh(["apt-get", "download"] + want, cwd=debs)
    xdir = os.path.join(WORK, "x")
    roots = {}
    for p, v in PACKAGES:
        deb = [f for f in os.listdir(debs) if f.startswith(p + "_")][0]
        ver = subprocess.run(["dpkg-deb", "-f", os.path.join(debs, deb), "Version"],
                             check=True, capture_output=True, text=True).stdout.strip()
        assert ver == v, (p, ver, v)
        root = os.path.join(xdir, p)
        if not os.path.isdir(root):
            os.makedirs(root)
            sh(["dpkg-deb", "-x", os.path.join(debs, deb), root])
        roots[p] = root
    return roots


class HtmlText(html.parser.HTMLParser):
    """Minimal HTML to text: drops script/style/nav, keeps block structure."""
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre",
             "dt", "dd", "table", "section", "blockquote", "hr", "title"}
    SKIP = {"script", "style", "head"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skip, self.pre = [], 0, 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self.out.append("\n\n" if tag not in ("br", "li", "tr", "dt", "dd") else "\n")
        if tag == "li":
            self.out.append("* ")

    def handle_endtag(self, tag):
        if tag in self.SKIP and self.skip:
            self.skip -= 1
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in self.BLOCK:
            self.out.append("\n")

    def handle_data(self, data):
        if self.skip:
            return
        if not self.pre:
            data = re.sub(r"[ \t\r\n]+", " ", data)
        self.out.append(data)

    def text(self):
        t = "".join(self.out)
        t = "\n".join(line.rstrip() for line in t.split("\n"))
        return re.sub(r"\n (?=\S)", "\n", t)


def html_to_text(path, body_only_class=None):
    with open(path, encoding="utf-8", errors="replace") as f:
        src = f.read()
    # Keep the main content only where the generator marks it.
    m = re.search(r'<div[^>]*(?:class="(?:body|book|chapter|sect1|refentry|appendix|preface|'
                  r'part|reference|set|index|toc)")', src)
    p = HtmlText()
    p.feed(src[m.start():] if m else src)
    t = p.text()
    for junk in ("Prev Up Next", "Submit correction", "Home Next", "Prev Home Next"):
        t = t.replace(junk, "")
    return t


def clean(t):
    t = t.replace(SEP, " ").replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    t = t.replace("\x0c", "\n").replace("\xa0", " ")
    t = "\n".join(line.rstrip() for line in t.split("\n"))
    t = re.sub(r"\n{3,}", "\n\n", t)
    return t.strip() + "\n"


def group(prefix, pieces):
    """pieces: ordered list of (name, text). Joins into documents of <= CAP_CHARS."""
    docs, cur, cur_len, n = [], [], 0, 0

    def flush():
        nonlocal cur, cur_len, n
        if cur:
            docs.append((f"{prefix}#{n}", "\n\n".join(cur)))
            n += 1
        cur, cur_len = [], 0

    for name, text in pieces:
        text = clean(text)
        if len(text) < 200:
            continue
        if len(text) > SPLIT_CHARS:
            flush()
            paras, part = text.split("\n\n"), []
            plen = 0
            for para in paras:
                part.append(para)
                plen += len(para) + 2
                if plen >= CAP_CHARS:
                    cur = ["\n\n".join(part)]
                    flush()
                    part, plen = [], 0
            if part:
                cur = ["\n\n".join(part)]
                flush()
            continue
        if cur_len + len(text) > CAP_CHARS and cur:
            flush()
        cur.append(text)
        cur_len += len(text) + 2
    flush()
    return docs


def sphinx_sources(root, sub, exclude=()):
    base = os.path.join(root, sub)
    groups = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        rel = os.path.relpath(dirpath, base)
        top = rel.split(os.sep)[0] if rel != "." else "_top"
        if top in exclude:
            continue
        for fn in sorted(filenames):
            if fn.endswith(".txt"):
                with open(os.path.join(dirpath, fn), encoding="utf-8", errors="replace") as f:
                    groups.setdefault(top, []).append((os.path.join(rel, fn), f.read()))
    return groups


def find_dir(root, sub):
    """The handler's subdirectory, or the first directory under root whose path
    ends with its last component (package layouts differ a little)."""
    p = os.path.join(root, sub)
    if os.path.isdir(p):
        return p
    tail = sub.rstrip("/").split("/")[-1]
    for dirpath, dirnames, _ in os.walk(root):
        dirnames.sort()
        if os.path.basename(dirpath) == tail:
            return dirpath
    raise FileNotFoundError(p)


def extra_docs(pkg, root):
    kind, sub, rx = EXTRA[pkg]
    base = find_dir(root, sub)
    if kind == "sphinx":
        g = sphinx_sources(base, ".")
        return [d for top in sorted(g) for d in group(f"{pkg}/{top}", g[top])]
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        for fn in sorted(filenames):
            path = os.path.join(dirpath, fn)
            if rx and not re.search(rx, path):
                continue
            files.append(path)
    docs = []
    if kind == "info":
        manuals = {}
        for path in files:
            m = re.match(r"(.*)\.info(-(\d+))?\.gz$", os.path.relpath(path, base))
            if m:
                manuals.setdefault(m.group(1), []).append((int(m.group(3) or 0), path))
        for name in sorted(manuals):
            parts = []
            for _, path in sorted(manuals[name]):
                with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                    t = f.read()
                t = re.sub(r"\x1f\n?(File: [^\n]*\n)?", "\n", t)
                t = re.sub(r"\x00\x08\[[^\x00]*\x00\x08\]", "", t)
                parts.append((path, t))
            docs += group(f"{pkg}/{name}", parts)
        return docs
    groups = {}
    for path in files:
        if kind == "html" and path.endswith(".html"):
            groups.setdefault(os.path.dirname(os.path.relpath(path, base)), []).append(
                (path, html_to_text(path)))
        elif kind == "text":
            with open(path, encoding="utf-8", errors="replace") as f:
                groups.setdefault(os.path.dirname(os.path.relpath(path, base)), []).append(
                    (path, f.read()))
    for d in sorted(groups):
        docs += group(f"{pkg}/{d or '_top'}", groups[d])
    return docs


def main():
    roots = fetch()
    docs = []
    for pkg in EXTRA:
        n0 = len(docs)
        docs += extra_docs(pkg, roots[pkg])
        print(pkg, len(docs) - n0, sum(len(t) for _, t in docs[n0:]), flush=True)
    # linux-doc: Sphinx sources, grouped by top-level directory (one manual each).
    lroot = roots["linux-doc-6.1"]
    g = sphinx_sources(lroot, "usr/share/doc/linux-doc-6.1/html/_sources", exclude=("translations",))
    for top in sorted(g):
        docs += group(f"linux-doc-6.1/{top}", g[top])
    # python3.11-doc: Sphinx sources by top-level directory.
    g = sphinx_sources(roots["python3.11-doc"], "usr/share/doc/python3.11/html/_sources")
    for top in sorted(g):
        docs += group(f"python3.11-doc/{top}", g[top])
    # git-doc: AsciiDoc sources; the user manual alone, the reference pages together.
    gdir = os.path.join(roots["git-doc"], "usr/share/doc/git-doc")
    pages, manual = [], []
    for fn in sorted(os.listdir(gdir)):
        if fn.endswith(".txt"):
            with open(os.path.join(gdir, fn), encoding="utf-8", errors="replace") as f:
                (manual if fn.startswith("user-manual") else pages).append((fn, f.read()))
    docs += group("git-doc/user-manual", manual)
    docs += group("git-doc/reference", [p for p in pages if p[0].startswith("git")])
    docs += group("git-doc/other", [p for p in pages if not p[0].startswith("git")])
    # perl-doc: each core pod is one document (perlfunc etc. are long).
    pdir = os.path.join(roots["perl-doc"], "usr/share/perl/5.36.0/pod")
    for fn in sorted(os.listdir(pdir)):
        if fn.endswith(".pod"):
            r = subprocess.run(["pod2text", "-w", "78", os.path.join(pdir, fn)],
                               capture_output=True, text=True, errors="replace")
            docs += group(f"perl-doc/{fn[:-4]}", [(fn, r.stdout)])
    # postgresql-doc-15: HTML pages, grouped by file-name prefix (chapter-like).
    hdir = os.path.join(roots["postgresql-doc-15"], "usr/share/doc/postgresql-doc-15/html")
    pg = {}
    for fn in sorted(os.listdir(hdir)):
        if fn.endswith(".html"):
            key = re.split(r"[-.]", fn)[0]
            pg.setdefault(key, []).append((fn, html_to_text(os.path.join(hdir, fn))))
    for key in sorted(pg):
        docs += group(f"postgresql-doc-15/{key}", pg[key])
    # debian-reference-en: the whole reference as text, one chapter per piece.
    dref = os.path.join(roots["debian-reference-en"], "usr/share/doc/debian-reference-en/docs")
    pieces = []
    for fn in sorted(os.listdir(dref)):
        if fn.endswith(".en.html") and fn != "index.en.html":
            pieces.append((fn, html_to_text(os.path.join(dref, fn))))
    docs += group("debian-reference-en/book", pieces)

    # Deterministic hold-out.
    def h(name):
        return hashlib.md5(name.encode()).hexdigest()

    total = sum(len(t) for _, t in docs)
    order = sorted(range(len(docs)), key=lambda i: h(docs[i][0]))
    held = set()
    for i in order:
        if len([j for j in held if len(docs[j][1]) >= LONG_CHARS]) >= MIN_LONG_HELDOUT:
            break
        if len(docs[i][1]) >= LONG_CHARS and "uniprops" not in docs[i][0] \
                and "/_modules/" not in docs[i][0]:
            held.add(i)
    # Then shorter documents, for variety, until they make up SHORT_FRACTION.
    held_chars = 0
    for i in order:
        if held_chars >= SHORT_FRACTION * total:
            break
        if i not in held and len(docs[i][1]) < LONG_CHARS:
            held.add(i)
            held_chars += len(docs[i][1])

    out = os.path.join(WORK, "corpus")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "train.txt"), "w", encoding="utf-8") as ft, \
            open(os.path.join(out, "heldout.txt"), "w", encoding="utf-8") as fh, \
            open(os.path.join(out, "docs.tsv"), "w", encoding="utf-8") as fd:
        fd.write("split\tname\tchars\n")
        for i, (name, text) in enumerate(docs):
            split = "heldout" if i in held else "train"
            f = fh if i in held else ft
            f.write(text)
            f.write(SEP + "\n")
            fd.write(f"{split}\t{name}\t{len(text)}\n")
    ntrain = sum(len(docs[i][1]) for i in range(len(docs)) if i not in held)
    with open(os.path.join(HERE, "corpus_manifest.txt"), "w") as fm:
        fm.write("# Corpus of the ctxcache reference model (rebuild: python3 model/train/make_corpus.py)\n")
        fm.write("# Debian 12 (bookworm) packages, fetched with apt-get download:\n")
        for p, v in PACKAGES:
            fm.write(f"package\t{p}\t{v}\n")
        fm.write(f"documents\t{len(docs)}\ttrain\t{len(docs) - len(held)}\theldout\t{len(held)}\n")
        fm.write(f"chars\t{total}\ttrain\t{ntrain}\theldout\t{total - ntrain}\n")
        fm.write("# held-out documents (md5-ordered: MIN_LONG_HELDOUT long ones, then short ones):\n")
        for i in sorted(held, key=lambda i: docs[i][0]):
            fm.write(f"heldout\t{docs[i][0]}\t{len(docs[i][1])}\n")
    print(f"docs={len(docs)} held={len(held)} chars={total} train={ntrain} heldout={total - ntrain}")


if __name__ == "__main__":
    main()
