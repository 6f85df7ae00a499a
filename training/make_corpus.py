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
     holds only "\x1e"), WORK/corpus/docs.tsv and training/corpus_manifest.txt,
  7. extra training-only batch (EXTRA_TRAIN_PACKAGES, handlers in EXTRA_TRAIN:
     sphinx/info/html/text as above, HTML cut to the content region of its
     generator (mdBook, rustdoc, Scribble, qdoc, javadoc, DocBook, gtk-doc),
     headers/footers repeated across pages dropped, roff man pages rendered with
     groff; English only): fetched, converted and grouped the same way, but ALL
     of it is training text, written to WORK/corpus/train_extra.txt (same format
     as train.txt) and WORK/corpus/docs_extra.tsv. It never enters the hold-out
     selection, so steps 1-6 and their outputs do not depend on it; the manifest
     gets a separate section (extra_package / extra_documents / extra_chars).

Usage: python3 training/make_corpus.py [WORK] [--extra-only | --no-extra] [--only=PKG,...]
  (default WORK training/work; default builds everything. --extra-only
  rebuilds only train_extra.txt/docs_extra.tsv and the manifest's extra section,
  --no-extra only steps 1-6; --only= with --extra-only writes an extra batch of
  just those packages for inspection and leaves the manifest alone.)
"""
import gzip
import hashlib
import html.parser
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
FLAGS = {a for a in sys.argv[1:] if a.startswith("--")}
WORK = ARGS[0] if ARGS else os.path.join(HERE, "work")
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


def fetch(packages=PACKAGES):
    debs = os.path.join(WORK, "debs")
    os.makedirs(debs, exist_ok=True)
    have = os.listdir(debs)
    want = [f"{p}={v}" for p, v in packages if not any(f.startswith(p + "_") for f in have)]
    if want:
        sh(["apt-get", "download"] + want, cwd=debs)
    xdir = os.path.join(WORK, "x")
    roots = {}
    for p, v in packages:
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


def walk_files(base, rx, skip_links=False):
    """Files under base in sorted order whose path matches rx (all if empty)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        for fn in sorted(filenames):
            path = os.path.join(dirpath, fn)
            if (skip_links and os.path.islink(path)) or (rx and not re.search(rx, path)):
                continue
            files.append(path)
    return files


def info_docs(files, base, tag, strip_tag_tables=False):
    """Info manuals (NAME.info[-N].gz) as documents, one group per manual.
    strip_tag_tables also drops the tag tables and indirect tables (the extra
    batch; the first two batches keep them so that train.txt stays as built)."""
    manuals = {}
    for path in files:
        m = re.match(r"(.*)\.info(-(\d+))?\.gz$", os.path.relpath(path, base))
        if m:
            manuals.setdefault(m.group(1), []).append((int(m.group(3) or 0), path))
    docs = []
    for name in sorted(manuals):
        parts = []
        for _, path in sorted(manuals[name]):
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                t = f.read()
            t = re.sub(r"\x1f\n?(File: [^\n]*\n)?", "\n", t)
            t = re.sub(r"\x00\x08\[[^\x00]*\x00\x08\]", "", t)
            if strip_tag_tables:
                t = re.sub(r"\nTag Table:\n.*?End Tag Table\n?", "\n", t, flags=re.S)
                t = re.sub(r"\nIndirect:\n(?:[^\n]*: \d+\n)+", "\n", t)
            parts.append((path, t))
        docs += group(f"{tag}/{name}", parts)
    return docs


def extra_docs(pkg, root):
    kind, sub, rx = EXTRA[pkg]
    base = find_dir(root, sub)
    if kind == "sphinx":
        g = sphinx_sources(base, ".")
        return [d for top in sorted(g) for d in group(f"{pkg}/{top}", g[top])]
    files = walk_files(base, rx)
    docs = []
    if kind == "info":
        return info_docs(files, base, pkg)
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


# Third batch: training-only packages. Their documents go to train_extra.txt and
# docs_extra.tsv only; they never take part in the hold-out selection, so
# train.txt, heldout.txt and docs.tsv do not depend on them.
EXTRA_TRAIN_PACKAGES = [
    ("rust-doc", "1.63.0+dfsg1-2"),
    ("racket-doc", "8.7+dfsg1-1"),
    ("ghc-doc", "9.0.2-4"),
    ("python-pandas-doc", "1.5.3+dfsg-2"),
    ("python-sklearn-doc", "1.2.1+dfsg-1"),
    ("python-statsmodels-doc", "0.13.5+dfsg-7"),
    ("python-astropy-doc", "5.2.1-2+deb12u1"),
    ("python-sympy-doc", "1.11.1-1"),
    ("python-dask-doc", "2022.12.1+dfsg-2"),
    ("python-xarray-doc", "2023.01.0-1.1"),
    ("python-skimage-doc", "0.19.3-8"),
    ("python-sqlalchemy-doc", "1.4.46+ds1-1"),
    ("python-flask-doc", "2.2.2-3"),
    ("python-werkzeug-doc", "2.2.2-3+deb12u1"),
    ("python-requests-doc", "2.28.1+dfsg-1"),
    ("python-pytest-doc", "7.2.1-2"),
    ("python-celery-doc", "5.2.6-5"),
    ("python-tornado-doc", "6.2.0-3+deb12u4"),
    ("python-pil-doc", "9.4.0-1.1+deb12u1"),
    ("python-scrapy-doc", "2.8.0-2"),
    ("python-lxml-doc", "4.9.2-1+deb12u1"),
    ("python-mpmath-doc", "1.2.1-2"),
    ("python-hypothesis-doc", "6.67.1-1"),
    ("python-psycopg2-doc", "2.9.5-1"),
    ("python-cffi-doc", "1.15.1-5"),
    ("python-gevent-doc", "22.10.2-3"),
    ("python-babel-doc", "2.10.3-1"),
    ("python-pygments-doc", "2.14.0+dfsg-1"),
    ("python-click-doc", "8.1.3-2"),
    ("python-pint-doc", "0.19.2-1"),
    ("cython-doc", "0.29.32-2"),
    ("python-tables-doc", "3.7.0-5"),
    ("python-h5py-doc", "3.7.0-8"),
    ("python-aiohttp-doc", "3.8.4-1+deb12u2"),
    ("python-future-doc", "0.18.2-6"),
    ("python-pygame-doc", "2.1.2+dfsg-5"),
    ("python-ldap-doc", "3.4.3-2+deb12u1"),
    ("python-pymongo-doc", "3.11.0-1+deb12u2"),
    ("python-distributed-doc", "2022.12.1+ds.1-3"),
    ("python-lmfit-doc", "1.1.0-1"),
    ("python-biopython-doc", "1.80+dfsg-4"),
    ("llvm-15-doc", "1:15.0.6-4"),
    ("clang-15-doc", "1:15.0.6-4"),
    ("bind9-doc", "1:9.18.49-1~deb12u3"),
    ("haproxy-doc", "2.6.12-1+deb12u4"),
    ("exim4-doc-html", "4.96-1"),
    ("wireshark-doc", "4.0.17-0+deb12u3"),
    ("postgis-doc", "3.3.2+dfsg-1"),
    ("swi-prolog-doc", "9.0.4+dfsg-2"),
    ("clisp-doc", "1:2.49.20210628.gitde01f0f-3"),
    ("sbcl-doc", "2:2.2.9-1"),
    ("guile-3.0-doc", "3.0.8-2"),
    ("gnu-standards", "2022.03.23-0.1"),
    ("haskell98-report", "20080907-10"),
    ("lilypond-doc", "2.24.1-2"),
    ("qtbase5-doc-html", "5.15.8+dfsg-11+deb12u3"),
    ("libboost1.81-doc", "1.81.0-5+deb12u1"),
    ("libglib2.0-doc", "2.74.6-2+deb12u9"),
    ("libgtk-3-doc", "3.24.38-2~deb12u3"),
    ("binutils-doc", "2.40-2"),
    ("libtool-doc", "2.4.7-7~deb12u1"),
    ("libgcrypt20-doc", "1.10.1-3+deb12u1"),
    ("mailutils-doc", "1:3.15-4"),
    ("m4-doc", "1.4.19-3"),
    ("gettext-doc", "0.21-12"),
    ("flex-doc", "2.6.4-8.2"),
    ("ffmpeg-doc", "7:5.1.9-0+deb12u1"),
    ("libssl-doc", "3.0.22-1~deb12u2"),
    ("libcurl4-doc", "7.88.1-10+deb12u15"),
    ("manpages", "6.03-2"),
    ("manpages-dev", "6.03-2"),
    ("freebsd-manpages", "12.2-1"),
    ("tcl8.6-doc", "8.6.13+dfsg-2"),
    ("openjdk-17-doc", "17.0.21.1+2-1~deb12u1"),
    ("debian-handbook", "11.20220922"),
    ("gnucash-docs", "4.13-1"),
    ("installation-guide-amd64", "20230508+deb12u1"),
    ("debian-history", "2.28"),
    ("debian-faq", "11.1"),
    ("harden-doc", "3.19+nmu1"),
    ("maint-guide", "1.2.53"),
    ("debmake-doc", "1.17-7"),
]
# Content regions of generated HTML (start, end regexes; the page is cut to the
# text between them, so navigation and sidebars are dropped).
MDBOOK = (r"<main>", r"</main>")
SPHINX_HTML = (r'role="main"', r'<div class="sphinxsidebar"|<footer|</article>|<div class="footer"')
SCRIBBLE = (r'<div class="main">', r'<div class="navsetbottom">')
RUSTDOC = (r'<section id="main-content"', r'<h2 id="(?:trait-implementations|synthetic-implementations|'
           r'blanket-implementations|implementors)"|<section id="search"|</main>')
JAVADOC = (r'<main role="main">', r'</main>', (r'<section class="summary">', r'<section class="details">'))
QTDOC = (r'<div class="content mainContent">|<div class="sidebar">', r'<div class="footer-main">|</body>')
BOOST = (r'<div class="(?:section|chapter|book|article|part|preface|appendix|refentry)"',
         r'<table[^>]*width="100%"><tr>|<div class="copyright-footer">|</body>')
GTKDOC = (r'<div class="(?:refentry|chapter|part|book|sect1|refsect1)"', r'<div class="footer">|</body>')
DOCBOOK = (r'<div class="(?:book|chapter|sect1|section|appendix|preface|part|article|refentry|glossary)"',
           r'<div class="navfooter">|<div class="footer"|</body>')
SPHINX_RX = r"^(?!.*/_sources/(.*/)?(generated|api|_autosummary|reference/api)/).*(\.rst\.txt|(?<!\.ipynb)(?<!\.py)\.txt)$"
# package -> list of (handler, subdirectory, path filter regex, HTML region or None).
# Handlers as in EXTRA, plus "man": roff man pages rendered with groff.
EXTRA_TRAIN = {
    "rust-doc": [("html", "usr/share/doc/rust-doc/html", r"/html/(book|reference|nomicon|rust-by-example|edition-guide|"
                  r"embedded-book|rustc|rustdoc|unstable-book)/(?!.*/(print|toc|SUMMARY|404)\.html$)(?!book/20\d\d-edition/)", MDBOOK),
                 ("html", "usr/share/doc/rust-doc/html/std", r"^(?!.*/all\.html$)", RUSTDOC)],
    "openjdk-17-doc": [("html", "usr/share/doc/openjdk-17-jre-headless/api", r"^(?!.*/(class-use|index-files|"
                        r"legal|resources|script-dir)/)(?!.*/([a-z-]+-(tree|use|list)|allclasses-index|allpackages-index|"
                        r"constant-values|serialized-form|help-doc|search|index|overview-summary)\.html$)", JAVADOC)],
    "racket-doc": [("html", "usr/share/doc/racket", r"^(?!.*/racket/(search|local-redirect|license)/)(?!.*/(doc-)?index\.html$)", SCRIBBLE)],
    "ghc-doc": [("sphinx", "usr/share/doc/ghc-doc/html/users_guide/_sources", SPHINX_RX, None)],
    "python-pandas-doc": [("sphinx", "usr/share/doc/python-pandas-doc/html/_sources", SPHINX_RX, None),
                          ("html", "usr/share/doc/python-pandas-doc/html/reference/api", r"\.html$", (r'role="main"', r'</main>|<div class=.prev-next-bottom'))],
    "python-sklearn-doc": [("sphinx", "usr/share/doc/python-sklearn-doc/html/_sources", SPHINX_RX, None)],
    "python-statsmodels-doc": [("sphinx", "usr/share/doc/python-statsmodels-doc/html/_sources", SPHINX_RX, None)],
    "python-astropy-doc": [("sphinx", "usr/share/doc/python-astropy-doc/html/_sources", SPHINX_RX, None)],
    "python-sympy-doc": [("sphinx", "usr/share/doc/python-sympy-doc/html/_sources", SPHINX_RX, None)],
    "python-dask-doc": [("sphinx", "usr/share/doc/python-dask-doc/html/_sources", SPHINX_RX, None)],
    "python-xarray-doc": [("sphinx", "usr/share/doc/python-xarray-doc/html/_sources", SPHINX_RX, None)],
    "python-skimage-doc": [("sphinx", "usr/share/doc/python-skimage-doc/html/_sources", SPHINX_RX, None)],
    "python-sqlalchemy-doc": [("html", "usr/share/doc/python-sqlalchemy-doc/html", r"^(?!.*/(_modules|_static|_images)/)(?!.*/(genindex|search|contents|copyright)\.html$)", SPHINX_HTML)],
    "python-flask-doc": [("sphinx", "usr/share/doc/python-flask-doc/html/_sources", SPHINX_RX, None)],
    "python-werkzeug-doc": [("sphinx", "usr/share/doc/python-werkzeug-doc/html/_sources", SPHINX_RX, None)],
    "python-requests-doc": [("sphinx", "usr/share/doc/python-requests-doc/html/_sources", SPHINX_RX, None)],
    "python-pytest-doc": [("sphinx", "usr/share/doc/python-pytest-doc/html/_sources", SPHINX_RX, None)],
    "python-celery-doc": [("sphinx", "usr/share/doc/python-celery-doc/html/_sources", SPHINX_RX, None)],
    "python-tornado-doc": [("sphinx", "usr/share/doc/python-tornado-doc/html/_sources", SPHINX_RX, None)],
    "python-pil-doc": [("sphinx", "usr/share/doc/python-pil-doc/html/_sources", SPHINX_RX, None)],
    "python-scrapy-doc": [("html", "usr/share/doc/python-scrapy-doc/html", r"^(?!.*/(_modules|_static|_images)/)(?!.*/(genindex|search|py-modindex)\.html$)", SPHINX_HTML)],
    "python-lxml-doc": [("html", "usr/share/doc/python-lxml/html", r"^(?!.*/(apidoc|api)/)", None)],
    "python-mpmath-doc": [("sphinx", "usr/share/doc/python-mpmath-doc/html/_sources", SPHINX_RX, None)],
    "python-hypothesis-doc": [("sphinx", "usr/share/doc/python-hypothesis-doc/html/_sources", SPHINX_RX, None)],
    "python-psycopg2-doc": [("sphinx", "usr/share/doc/python-psycopg2-doc/html/_sources", SPHINX_RX, None)],
    "python-cffi-doc": [("sphinx", "usr/share/doc/python-cffi-doc/html/_sources", SPHINX_RX, None)],
    "python-gevent-doc": [("sphinx", "usr/share/doc/python-gevent-doc/html/_sources", SPHINX_RX, None)],
    "python-babel-doc": [("sphinx", "usr/share/doc/python-babel-doc/html/_sources", SPHINX_RX, None)],
    "python-pygments-doc": [("sphinx", "usr/share/doc/python-pygments-doc/html/_sources", SPHINX_RX, None)],
    "python-click-doc": [("sphinx", "usr/share/doc/python-click-doc/html/_sources", SPHINX_RX, None)],
    "python-pint-doc": [("sphinx", "usr/share/doc/python-pint-doc/html/_sources", SPHINX_RX, None)],
    "cython-doc": [("sphinx", "usr/share/doc/cython-doc/html/_sources", SPHINX_RX, None)],
    "python-tables-doc": [("sphinx", "usr/share/doc/python-tables-doc/html/_sources", SPHINX_RX, None)],
    "python-h5py-doc": [("sphinx", "usr/share/doc/python-h5py-doc/html/_sources", SPHINX_RX, None)],
    "python-aiohttp-doc": [("sphinx", "usr/share/doc/python-aiohttp-doc/html/_sources", SPHINX_RX, None)],
    "python-future-doc": [("sphinx", "usr/share/doc/python-future-doc/html/_sources", SPHINX_RX, None)],
    "python-pygame-doc": [("sphinx", "usr/share/doc/python-pygame-doc/html/_sources", SPHINX_RX, None)],
    "python-ldap-doc": [("sphinx", "usr/share/doc/python-ldap-doc/html/_sources", SPHINX_RX, None)],
    "python-pymongo-doc": [("sphinx", "usr/share/doc/python-pymongo-doc/html/_sources", SPHINX_RX, None)],
    "python-distributed-doc": [("sphinx", "usr/share/doc/python-distributed-doc/html/_sources", SPHINX_RX, None)],
    "python-lmfit-doc": [("sphinx", "usr/share/doc/python3-lmfit/html/_sources", SPHINX_RX, None)],
    "python-biopython-doc": [("html", "usr/share/doc/python-biopython-doc/Doc", r"/Doc/Tutorial\.html$", None)],
    "llvm-15-doc": [("sphinx", "usr/share/doc/llvm-15-doc/html/_sources", r"^(?!.*/_sources/AMDGPU/)" + SPHINX_RX[1:], None)],
    "clang-15-doc": [("sphinx", "usr/share/doc/clang-15/html/_sources", r"^(?!.*/ClangFormattedStatus)" + SPHINX_RX[1:], None)],
    "bind9-doc": [("html", "usr/share/doc/bind9-doc/arm", r"/(chapter\d+|dnssec-guide|general|reference|history|notes|manpages)\.html$", SPHINX_HTML)],
    "haproxy-doc": [("html", "usr/share/doc/haproxy-doc/html", r"\.html$", None)],
    "exim4-doc-html": [("html", "usr/share/doc/exim4-doc-html/spec_html", r"ch-.*(?<!_index)\.html$", None)],
    "wireshark-doc": [("html", "usr/share/doc/wireshark", r"/ws[ud]g_html_chunked/[^/]*\.html$", DOCBOOK)],
    "postgis-doc": [("html", "usr/share/doc/postgis-doc", r"\.html$", None)],
    "swi-prolog-doc": [("html", "usr/share/swi-prolog/doc", r"/(Manual|packages)/[^/]*\.html$", None)],
    "clisp-doc": [("html", "usr/share/doc/clisp/doc", r"/impnotes\.html$", None),
                  ("text", "usr/share/doc/clisp/doc", r"\.txt\.gz$", None)],
    "sbcl-doc": [("info", "usr/share/info", r"", None)],
    "guile-3.0-doc": [("info", "usr/share/info", r"", None)],
    "gnu-standards": [("info", "usr/share/info", r"", None)],
    "haskell98-report": [("html", "usr/share/doc/haskell98-report/html", r"\.html$", None)],
    "lilypond-doc": [("info", "usr/share/info", r"/(lilypond-(changes|essay|extending|learning|notation|usage)|music-glossary)\.info", None)],
    "qtbase5-doc-html": [("html", "usr/share/qt5/doc", r"(?<!-members)(?<!-obsolete)\.html$", QTDOC)],
    "libboost1.81-doc": [("html", "usr/share/doc/libboost1.81-doc", r"^(?!.*/doc/html/boost/).*\.html?$", BOOST)],
    "libglib2.0-doc": [("html", "usr/share/gtk-doc/html", r"\.html$", GTKDOC)],
    "libgtk-3-doc": [("html", "usr/share/gtk-doc/html", r"\.html$", GTKDOC)],
    "binutils-doc": [("info", "usr/share/info", r"", None)],
    "libtool-doc": [("info", "usr/share/info", r"", None)],
    "libgcrypt20-doc": [("info", "usr/share/info", r"", None)],
    "mailutils-doc": [("info", "usr/share/info", r"", None)],
    "m4-doc": [("html", "usr/share/doc/m4", r"\.html$", None)],
    "gettext-doc": [("html", "usr/share/doc/gettext", r"^(?!.*/(examples|csharpdoc|javadoc2?)/).*\.html$", None)],
    "flex-doc": [("html", "usr/share/doc/flex-doc/html", r"\.html$", None)],
    "ffmpeg-doc": [("html", "usr/share/doc/ffmpeg/manual", r"(?<!-all)\.html$", None)],
    "libssl-doc": [("man", "usr/share/man", r"", None)],
    "libcurl4-doc": [("man", "usr/share/man", r"", None)],
    "manpages": [("man", "usr/share/man", r"", None)],
    "manpages-dev": [("man", "usr/share/man", r"", None)],
    "freebsd-manpages": [("man", "usr/share/man", r"", None)],
    "tcl8.6-doc": [("man", "usr/share/man", r"", None)],
    "debian-handbook": [("html", "usr/share/doc/debian-handbook/html/en-US", r"\.html$", DOCBOOK)],
    "gnucash-docs": [("html", "usr/share/doc/gnucash-docs", r"/gnucash-(guide|help)-en/[^/]*\.html$", DOCBOOK)],
    "installation-guide-amd64": [("html", "usr/share/doc/installation-guide-amd64/en", r"\.html$", DOCBOOK)],
    "debian-history": [("html", "usr/share/doc/debian-history/docs", r"\.en\.html$", DOCBOOK)],
    "debian-faq": [("html", "usr/share/doc/debian/FAQ", r"\.html$", DOCBOOK)],
    "harden-doc": [("html", "usr/share/doc/harden-doc/html/en-US", r"\.html$", DOCBOOK)],
    "maint-guide": [("html", "usr/share/doc/maint-guide/html", r"\.en\.html$", DOCBOOK)],
    "debmake-doc": [("html", "usr/share/doc/debmake-doc/html", r"\.en\.html$", DOCBOOK)],
}


def html_region_text(path, region):
    """Like html_to_text, but keeps only the text between region's start and
    end regexes (None: html_to_text's heuristic)."""
    if region is None:
        t = html_to_text(path)
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            src = f.read()
        m = re.search(region[0], src)
        if m:
            src = src[m.start():]
        e = re.search(region[1], src[1:])
        if e:
            src = src[:e.start() + 1]
        for cut0, cut1 in region[2:]:  # optional spans to drop (start, end regexes)
            a = re.search(cut0, src)
            b = a and re.search(cut1, src[a.end():])
            if b:
                src = src[:a.start()] + src[a.end() + b.start():]
        p = HtmlText()
        p.feed(src)
        t = p.text()
    t = t.replace("\u00b6", "").replace("[source]", "")
    # Texinfo HTML navigation lines.
    t = re.sub(r"(?m)^(Next|Previous|Up): [^\n]*(, (Previous|Up): |\[Contents\])[^\n]*\n", "", t)
    if region is RUSTDOC:
        t = re.sub(r"(?m)^(Run|source|\[src\]|[\d.]+ · source)\n", "", t)
    # Line-number columns of code listings (gtk-doc, some DocBook): 1, 2, 3, ...
    return re.sub(r"(?m)^1\n+2\n+3\n+(?:\d+\n+)*", "", t)


def strip_common(pages):
    """Drops leading and trailing lines that repeat on many pages of one source
    (navigation, headers, footers)."""
    if len(pages) < 4:
        return pages
    counts = {}
    for _, t in pages:
        lines = [l.strip() for l in t.split("\n") if l.strip()]
        for l in set(lines[:15] + lines[-15:]):
            counts[l] = counts.get(l, 0) + 1
    common = {l for l, c in counts.items() if c >= max(4, 0.3 * len(pages))}
    out = []
    for name, t in pages:
        lines = t.split("\n")
        while lines and (not lines[0].strip() or lines[0].strip() in common):
            lines.pop(0)
        while lines and (not lines[-1].strip() or lines[-1].strip() in common):
            lines.pop()
        out.append((name, "\n".join(lines)))
    return out


def man_text(path):
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        src = f.read()
    if src.lstrip().startswith(b".so ") and len(src) < 200:
        return ""  # a link to another page
    r = subprocess.run(["groff", "-k", "-t", "-mandoc", "-Tutf8", "-rLL=78n", "-rcR=1", "-rHY=0",
                        "-P-cbou"], input=src, capture_output=True)
    lines = r.stdout.decode("utf-8", "replace").split("\n")
    ne = [i for i, l in enumerate(lines) if l.strip()]
    if len(ne) < 3:
        return ""
    lines = lines[ne[0] + 1:ne[-1]]  # running header and footer
    out = []
    for l in lines:
        # Undo justification in filled text (not in tables: no wide gaps).
        if len(l) >= 60 and not re.search(r"\S {4,}\S", l):
            l = re.sub(r"(?<=\S) {2,}(?=\S)", " ", l)
        out.append(l)
    # Words hyphenated at line ends (mdoc pages ignore HY=0).
    return re.sub(r"(\w)\u2010\n\s+(\w)", r"\1\2", "\n".join(out))


def prose_ok(text, sphinx=False):
    """Rejects pages that are mostly numbers/punctuation (tables, dumps)."""
    t = text[:200_000]
    letters = sum(c.isalpha() for c in t)
    if not t or letters < 0.5 * len(t.replace(" ", "").replace("\n", "")):
        return False
    if not sphinx:
        return True
    # Sphinx stubs that are mostly autodoc/autosummary directives and bare names.
    lines = [l for l in t.split("\n") if l.strip()]
    stub = sum(1 for l in lines if re.match(r"\s*(\.\. (auto|current|toctree)|:\w+:|~?[\w.]+$|[=~^-]+$)", l))
    return stub < 0.5 * len(lines)


def extra_train_docs(pkg, root):
    from concurrent.futures import ThreadPoolExecutor
    docs = []
    for k, (kind, sub, rx, region) in enumerate(EXTRA_TRAIN[pkg]):
        base = find_dir(root, sub)
        tag = f"{pkg}/{os.path.basename(base)}" if k else pkg
        files = walk_files(base, rx, skip_links=True)
        if kind == "info":
            docs += info_docs(files, base, tag, strip_tag_tables=True)
            continue
        groups = {}
        if kind == "sphinx":
            keyf = lambda path: (os.path.relpath(path, base).split(os.sep) + ["_top"])[0] \
                if os.sep in os.path.relpath(path, base) else "_top"
        else:
            keyf = lambda path: os.path.dirname(os.path.relpath(path, base)) or "_top"
        if kind == "man":
            with ThreadPoolExecutor(2) as ex:
                texts = list(ex.map(man_text, files))
            for path, t in zip(files, texts):
                sec = os.path.basename(os.path.dirname(path))
                groups.setdefault(sec, []).append((path, t))
        else:
            for path in files:
                if kind == "html" and re.search(r"\.html?$", path):
                    t = html_region_text(path, region)
                elif kind in ("text", "sphinx"):
                    opener = gzip.open if path.endswith(".gz") else open
                    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
                        t = f.read()
                else:
                    continue
                groups.setdefault(keyf(path), []).append((path, t))
        seen = set()  # identical pages (hard links, copies) are kept once
        for d in sorted(groups):
            pages = strip_common(groups[d]) if kind == "html" else groups[d]
            pages = [(n, t) for n, t in pages if prose_ok(t, kind == "sphinx")]
            pages = [(n, t) for n, t in pages
                     if not (hashlib.md5(t.encode()).digest() in seen or seen.add(hashlib.md5(t.encode()).digest()))]
            docs += group(f"{tag}/{d}", pages)
    return docs


def build_extra():
    roots = fetch(EXTRA_TRAIN_PACKAGES)
    only = [a[len("--only="):].split(",") for a in FLAGS if a.startswith("--only=")]
    docs, per_pkg, seen_paras = [], [], set()
    for pkg, _ in EXTRA_TRAIN_PACKAGES:
        if only and pkg not in only[0]:
            continue
        n0 = len(docs)
        for name, text in extra_train_docs(pkg, roots[pkg]):
            # Paragraphs (> 200 chars) already seen in this batch are dropped:
            # license blocks, inherited API docs, pages shipped twice.
            keep = []
            for para in text.split("\n\n"):
                if len(para.strip()) > 200:
                    h = hashlib.md5(para.strip().encode()).digest()
                    if h in seen_paras:
                        continue
                    seen_paras.add(h)
                keep.append(para)
            text = "\n\n".join(keep)
            if len(text) >= 200:
                docs.append((name, text if text.endswith("\n") else text + "\n"))
        chars = sum(len(t) for _, t in docs[n0:])
        per_pkg.append((pkg, len(docs) - n0, chars))
        print("extra", pkg, len(docs) - n0, chars, flush=True)
    out = os.path.join(WORK, "corpus")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "train_extra.txt"), "w", encoding="utf-8") as ft, \
            open(os.path.join(out, "docs_extra.tsv"), "w", encoding="utf-8") as fd:
        fd.write("split\tname\tchars\n")
        for name, text in docs:
            ft.write(text)
            ft.write(SEP + "\n")
            fd.write(f"train\t{name}\t{len(text)}\n")
    if only:
        return
    # Manifest: replace the extra section, keep every other line as it is.
    mpath = os.path.join(HERE, "corpus_manifest.txt")
    marker = "# Extra training-only batch"
    lines = []
    if os.path.exists(mpath):
        with open(mpath) as fm:
            lines = fm.read().split("\n")
        if marker in "\n".join(lines):
            lines = lines[:[i for i, l in enumerate(lines) if l.startswith(marker)][0]]
        while lines and lines[-1] == "":
            lines.pop()
    with open(mpath, "w") as fm:
        for l in lines:
            fm.write(l + "\n")
        fm.write(f"{marker} (train_extra.txt, docs_extra.tsv; never held out):\n")
        for p, v in EXTRA_TRAIN_PACKAGES:
            fm.write(f"extra_package\t{p}\t{v}\n")
        fm.write(f"extra_documents\t{len(docs)}\n")
        fm.write(f"extra_chars\t{sum(len(t) for _, t in docs)}\n")
    print(f"extra docs={len(docs)} chars={sum(len(t) for _, t in docs)}")


def build_main():
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
        fm.write("# Corpus of the ctxcache reference model (rebuild: python3 training/make_corpus.py)\n")
        fm.write("# Debian 12 (bookworm) packages, fetched with apt-get download:\n")
        for p, v in PACKAGES:
            fm.write(f"package\t{p}\t{v}\n")
        fm.write(f"documents\t{len(docs)}\ttrain\t{len(docs) - len(held)}\theldout\t{len(held)}\n")
        fm.write(f"chars\t{total}\ttrain\t{ntrain}\theldout\t{total - ntrain}\n")
        fm.write("# held-out documents (md5-ordered: MIN_LONG_HELDOUT long ones, then short ones):\n")
        for i in sorted(held, key=lambda i: docs[i][0]):
            fm.write(f"heldout\t{docs[i][0]}\t{len(docs[i][1])}\n")
    print(f"docs={len(docs)} held={len(held)} chars={total} train={ntrain} heldout={total - ntrain}")


def main():
    mpath = os.path.join(HERE, "corpus_manifest.txt")
    kept = ""
    if "--no-extra" in FLAGS and os.path.exists(mpath):
        with open(mpath) as fm:
            m = fm.read()
        i = m.find("# Extra training-only batch")
        kept = m[i:] if i >= 0 else ""
    if "--extra-only" not in FLAGS:
        build_main()
    if "--no-extra" not in FLAGS:
        build_extra()
    elif kept:  # keep the manifest's extra section as it was
        with open(mpath, "a") as fm:
            fm.write(kept)


if __name__ == "__main__":
    main()
