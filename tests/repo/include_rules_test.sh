#!/usr/bin/env bash
# The include_rules ctest: every #include in every .h/.hpp/.cc/.cpp of the
# repository's top-level folders must obey cmake/module-rules.txt (the table
# that cmake/CtxcacheHelpers.cmake also turns into per-target include views):
#   - a project include ("index/csa.h", or an alias such as "ctxcache/v1/...")
#     must name a folder the file's module may include;
#   - no include may start with one of the module's forbidden external
#     prefixes (rocksdb/, grpcpp/, Eigen/, ...);
#   - no include may climb out with ".." or be absolute;
#   - every top-level folder with such files must have an allow line.
# Allow-listed exceptions are printed as warnings. No compiler needed; bash,
# awk and find only (git, when present, to skip ignored files).
# Usage: tests/repo/include_rules_test.sh [SOURCE_DIR [RULES_FILE]]
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/../.." && pwd)}"
rules="${2:-$root/cmake/module-rules.txt}"
rules="$(cd "$(dirname "$rules")" && pwd)/$(basename "$rules")"
cd "$root"

use_git=0
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then use_git=1; fi

# Top-level folders, without hidden ones, build trees and ignored ones.
folders=()
for d in */; do
  d="${d%/}"
  [ -L "$d" ] && continue
  [ -f "$d/CMakeCache.txt" ] && continue
  if [ "$use_git" = 1 ] && git check-ignore -q "$d/"; then continue; fi
  folders+=("$d")
done

list="$(mktemp)"
trap 'rm -f "$list"' EXIT
if [ "$use_git" = 1 ]; then
  # Tracked and untracked-but-not-ignored files (a new module counts at once).
  git ls-files -co --exclude-standard -- "${folders[@]}" |
    grep -E '\.(h|hh|hpp|cc|cpp)$' | sort -u |
    while IFS= read -r f; do if [ -f "$f" ]; then printf '%s\n' "$f"; fi; done >"$list"
else
  find "${folders[@]}" -name '.*' -prune -o -type f \
    \( -name '*.h' -o -name '*.hh' -o -name '*.hpp' -o -name '*.cc' -o -name '*.cpp' \) -print |
    sort >"$list"
fi

awk -v folders="${folders[*]}" -v rules_name="cmake/module-rules.txt" '
function fail(msg) { print msg; errors++ }
# The longest module with a line of this kind ("allow"/"forbid") holding path.
function module_of(path, kind,   p) {
  p = path
  while (p ~ /\//) {
    sub(/\/[^\/]*$/, "", p)
    if ((kind SUBSEP p) in has) return p
  }
  return ""
}
function allowed(mod, folder,   n, i, a) {
  n = split(allow[mod], a, " ")
  for (i = 1; i <= n; i++) if (a[i] == "*" || a[i] == folder) return 1
  return 0
}
BEGIN {
  nf = split(folders, f, " ")
  for (i = 1; i <= nf; i++) is_folder[f[i]] = 1
}
# ---- the rules file -------------------------------------------------------
FNR == NR {
  line = $0
  sub(/#.*/, "", line)
  if (line ~ /^[ \t]*$/) next
  if (match(line, /^[ \t]*(allow|forbid|alias|exception)[ \t]+[^ \t:]+[ \t]*:/) == 0) {
    fail(rules_name ":" FNR ": cannot parse: " $0); next
  }
  head = substr(line, 1, RLENGTH - 1); rest = substr(line, RLENGTH + 1)
  n = split(head, h, /[ \t]+/); kind = (h[1] == "" ? h[2] : h[1]); key = h[n]
  gsub(/^[ \t]+|[ \t]+$/, "", rest); gsub(/[ \t]+/, " ", rest)
  if (kind == "allow") { allow[key] = rest; has["allow" SUBSEP key] = 1 }
  else if (kind == "forbid") { forbid[key] = rest; has["forbid" SUBSEP key] = 1 }
  else if (kind == "alias") { alias[key] = rest }
  else { exc[key SUBSEP rest] = 1; exc_line[key SUBSEP rest] = FNR }
  next
}
# ---- the file list: scan each source --------------------------------------
{
  file = $0
  files++
  top = file; sub(/\/.*/, "", top)
  if (!(("allow" SUBSEP top) in has)) {
    if (!(top in missing)) {
      missing[top] = 1
      fail(rules_name ": top-level folder \"" top "/\" has sources (" file ") but no \"allow " top ":\" line")
    }
    next
  }
  amod = module_of(file, "allow"); fmod = module_of(file, "forbid")
  dir = file; sub(/\/[^\/]*$/, "", dir)
  ln = 0
  while ((getline text < file) > 0) {
    ln++
    if (text !~ /^[ \t]*#[ \t]*include[ \t]*[<"]/) continue
    inc = text
    sub(/^[ \t]*#[ \t]*include[ \t]*[<"]/, "", inc)
    sub(/[>"].*$/, "", inc)
    includes++
    where = file ":" ln ": "
    problem = ""
    if (inc ~ /^\// || inc ~ /(^|\/)\.\.(\/|$)/) {
      problem = "\"" inc "\" escapes the include view (absolute or \"..\" path)"
    }
    # Which project module does it name? Aliases first (longest), then folders.
    target = ""; best = 0
    for (a in alias) if (index(inc, a) == 1 && length(a) > best) { best = length(a); target = alias[a] }
    if (target == "" && inc ~ /\//) {
      first = inc; sub(/\/.*/, "", first)
      if (first in is_folder) target = first
    }
    if (problem == "" && target != "" && !allowed(amod, target)) {
      problem = amod "/ may not include " target "/: \"" inc "\" (allowed: " allow[amod] ")"
    }
    if (problem == "" && fmod != "") {
      n = split(forbid[fmod], fp, " ")
      for (i = 1; i <= n; i++) if (index(inc, fp[i]) == 1) {
        problem = fmod "/ may not include external \"" inc "\" (forbidden prefix " fp[i] ")"; break
      }
    }
    if (problem == "") continue
    if ((file SUBSEP inc) in exc) {
      seen[file SUBSEP inc] = 1; warnings++
      print where "warning: " problem " [allow-listed in " rules_name ":" exc_line[file SUBSEP inc] "]"
    } else {
      fail(where "error: " problem)
    }
  }
  close(file)
}
END {
  for (k in exc) if (!(k in seen)) {
    split(k, e, SUBSEP)
    print rules_name ":" exc_line[k] ": warning: exception \"" e[1] ": " e[2] "\" no longer occurs; delete it"
  }
  printf "include_rules: %d files, %d includes, %d violation(s), %d allow-listed\n", files, includes, errors, warnings
  if (errors > 0) {
    print "FAIL: fix the includes above, or change " rules_name " (see docs/architecture.md)"
    exit 1
  }
}
' "$rules" "$list"
