#!/usr/bin/env python3
"""ctest deploy_manifests: the deployment files are checked against the real
binaries, not only parsed.

1. deploy/compose.yaml and deploy/k8s/*.yaml parse, and hold what docs/deploy.md
   promises: etcd plus 3 nodes with a volume each; a StatefulSet with a PVC
   template, readiness and liveness probes; a headless Service; a
   PodDisruptionBudget; the etcd ConfigMap.
2. Every flag the manifests give ctxcached is one `ctxcached --help` lists, and
   every flag of the probes' CLI command one `ctxcache --help` lists.
3. deploy/make-secrets.sh makes the secrets; a real etcd and two ctxcached
   started with exactly the compose file's node arguments (the container's
   paths and host names mapped to a temp dir and loopback ports) form a
   cluster; the k8s probe command answers; `ctxcache cluster status` sees
   both nodes; and every metric the Grafana dashboard queries is exported.

Usage: validate_deploy.py SOURCE_DIR BIN_DIR   (Debian's python3-yaml, etcd-server)
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

SRC, BIN = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
sys.path.insert(0, os.path.join(SRC, "tests", "cluster"))
from cluster_harness import Etcd, free_port, wait_for  # noqa: E402

DEPLOY = os.path.join(SRC, "deploy")
failures = []


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def help_flags(binary: str, *args: str) -> set:
    out = subprocess.run([binary, *args, "--help"], capture_output=True, text=True).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out))


# 1. structure -------------------------------------------------------------
compose = yaml.safe_load(open(os.path.join(DEPLOY, "compose.yaml")))
svcs = compose["services"]
nodes = sorted(n for n in svcs if n.startswith("node"))
check("etcd" in svcs and len(nodes) == 3, "compose: etcd and node1..node3")
vols = [v for n in nodes for v in svcs[n]["volumes"] if v.endswith(":/data")]
check(len(set(vols)) == 3, "compose: one data volume per node")
docs = []
for name in sorted(os.listdir(os.path.join(DEPLOY, "k8s"))):
    if name.endswith(".yaml"):
        docs += [d for d in yaml.safe_load_all(open(os.path.join(DEPLOY, "k8s", name))) if d]
kinds = {d["kind"]: d for d in docs}
sts = kinds.get("StatefulSet")
check(sts is not None and bool(sts["spec"].get("volumeClaimTemplates")),
      "k8s: StatefulSet with a PVC per pod")
ctr = sts["spec"]["template"]["spec"]["containers"][0]
check("readinessProbe" in ctr and "livenessProbe" in ctr, "k8s: readiness and liveness probes")
check(kinds.get("Service", {}).get("spec", {}).get("clusterIP") == "None", "k8s: headless Service")
check("PodDisruptionBudget" in kinds, "k8s: PodDisruptionBudget")
check("etcd" in kinds.get("ConfigMap", {}).get("data", {}), "k8s: etcd endpoints ConfigMap")
secret_vol = [v for v in sts["spec"]["template"]["spec"]["volumes"] if "secret" in v]
check(bool(secret_vol), "k8s: keys and certificates from a Secret")
# Pod Security "restricted" admits the pods.
pod_sc = sts["spec"]["template"]["spec"].get("securityContext", {})
ctr_sc = ctr.get("securityContext", {})
check(pod_sc.get("runAsNonRoot") is True or ctr_sc.get("runAsNonRoot") is True,
      "k8s restricted: runAsNonRoot")
check(ctr_sc.get("allowPrivilegeEscalation") is False,
      "k8s restricted: allowPrivilegeEscalation false")
check(ctr_sc.get("capabilities", {}).get("drop") == ["ALL"], "k8s restricted: drop ALL")
check((ctr_sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
      in ("RuntimeDefault", "Localhost"), "k8s restricted: seccompProfile RuntimeDefault")
check(ctr_sc.get("readOnlyRootFilesystem") is True, "k8s: read-only root filesystem")
# The downward API reads the pod's own labels: a zone taken from them is
# empty (the zone label is the node's), so zone spreading would be off.
zone_env = [e for e in ctr.get("env", []) if e["name"] == "ZONE"]
check(bool(zone_env) and "metadata.labels" not in json.dumps(zone_env),
      "k8s: ZONE does not come from the pod's labels")
zone_key = [e["valueFrom"]["configMapKeyRef"]["key"] for e in zone_env
            if "configMapKeyRef" in e.get("valueFrom", {})]
check(all(k in kinds.get("ConfigMap", {}).get("data", {}) for k in zone_key),
      "k8s: the ConfigMap holds the ZONE key (an unset variable stays literal in args)")
for f in ("statefulset.yaml", "config.yaml", "service.yaml", "pdb.yaml"):
    text = open(os.path.join(DEPLOY, "k8s", f)).read()
    for ref in re.findall(r"(?:scripts|tests|deploy)/[\w./-]+\.(?:sh|py|yaml|md)", text):
        check(os.path.exists(os.path.join(SRC, ref)), f"k8s/{f}: {ref} exists")

# 2. flags ------------------------------------------------------------------
server_flags = help_flags(os.path.join(BIN, "ctxcached"))
cli_flags = help_flags(os.path.join(BIN, "ctxcache"))
dockerfile = open(os.path.join(DEPLOY, "Dockerfile")).read()
entry = json.loads(re.search(r"ENTRYPOINT (\[.*?\])\n", dockerfile.replace("\\\n", "")).group(1))
used = [a for n in nodes for a in svcs[n]["command"] if a.startswith("--")]
used += [a for a in ctr["args"] if a.startswith("--")] + [a for a in entry if a.startswith("--")]
for flag in sorted(set(used)):
    check(flag in server_flags, f"ctxcached knows {flag}")
probe = ctr["readinessProbe"]["exec"]["command"]
for flag in sorted({a for a in probe if a.startswith("--")}):
    check(flag in cli_flags, f"ctxcache knows {flag} (probe)")

# 3. a real cluster from the compose arguments ------------------------------
work = tempfile.mkdtemp(prefix="ctxcache-deploy-")
secrets = os.path.join(work, "secrets")
subprocess.run([os.path.join(DEPLOY, "make-secrets.sh"), secrets], check=True,
               env={**os.environ, "CTXCACHE_BIN": os.path.join(BIN, "ctxcache")})
os.makedirs(os.path.join(work, "etcd"))
etcd = Etcd(os.path.join(work, "etcd")).start()
procs, ports = [], {}
try:
    for n in nodes[:2]:
        ports[n] = (free_port(), free_port())
    for n in nodes[:2]:
        port, mport = ports[n]
        args = []
        for a in entry[1:] + svcs[n]["command"]:
            a = a.replace("/etc/ctxcache/secrets", secrets)
            a = a.replace("etcd://etcd:2379", f"etcd://{etcd.endpoint}")
            for m, (p, _) in ports.items():
                a = a.replace(f"{m}:7700", f"127.0.0.1:{p}")
            a = {"/data": os.path.join(work, n), "/models": os.path.join(SRC, "models"),
                 "0.0.0.0:7700": f"127.0.0.1:{port}",
                 "0.0.0.0:7701": f"127.0.0.1:{mport}"}.get(a, a)
            args.append(a)
        log = open(os.path.join(work, n + ".log"), "w")
        procs.append(subprocess.Popen([os.path.join(BIN, "ctxcached"), *args], stdout=log,
                                      stderr=subprocess.STDOUT))
    tls = ["--tls-ca", f"{secrets}/ca.pem", "--tls-cert", f"{secrets}/client.pem",
           "--tls-key", f"{secrets}/client.key"]
    cli = os.path.join(BIN, "ctxcache")

    def healthy(n: str) -> bool:
        cmd = [a.replace("/etc/ctxcache/secrets", secrets)
                .replace("localhost:7700", f"localhost:{ports[n][0]}") for a in probe]
        cmd[0] = cli
        return subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0

    for n in nodes[:2]:
        try:
            wait_for(lambda: healthy(n), 60, f"{n} healthy", interval=0.5)
            check(True, f"{n}: the k8s probe command answers")
        except Exception as e:  # noqa: BLE001
            check(False, f"{n}: the k8s probe command answers ({e}); log: "
                  + open(os.path.join(work, n + ".log")).read()[-1500:])

    def status() -> dict:
        r = subprocess.run([cli, *tls, "--api-key-file", f"{secrets}/operator.key", "--json",
                            "cluster", "status", "--server", f"127.0.0.1:{ports[nodes[0]][0]}"],
                           capture_output=True, text=True, timeout=30)
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {}

    try:
        wait_for(lambda: len(status().get("nodes", [])) == 2, 60, "2 nodes in cluster status",
                 interval=1.0)
        check(True, "ctxcache cluster status lists both nodes")
    except Exception as e:  # noqa: BLE001
        check(False, f"ctxcache cluster status lists both nodes ({e}): {status()}")

    token = open(f"{secrets}/metrics-token").read().strip()
    req = urllib.request.Request(f"http://127.0.0.1:{ports[nodes[0]][1]}/metrics",
                                 headers={"Authorization": f"Bearer {token}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    exported = {re.sub(r"_(bucket|sum|count)$", "", m)
                for m in re.findall(r"^(ctxcache_[a-z_]+)", text, re.M)}
    dash = json.load(open(os.path.join(DEPLOY, "grafana", "ctxcache-dashboard.json")))
    wanted = {re.sub(r"_(bucket|sum|count)$", "", m) for p in dash["panels"]
              for t in p["targets"] for m in re.findall(r"ctxcache_[a-z_]+", t["expr"])}
    # Families with labels (per method, tenant, reason) have no series until
    # traffic creates one; those must at least be registered by the server's
    # sources under that exact name.
    sources = ""
    for d in ("service", "cluster", "storage"):
        for root, _, files in os.walk(os.path.join(SRC, d)):
            sources += "".join(open(os.path.join(root, f)).read() for f in files
                               if f.endswith((".cc", ".h")))
    for m in sorted(wanted):
        if m in exported:
            check(True, f"dashboard metric {m} is exported")
        else:
            check(f'"{m}"' in sources,
                  f"dashboard metric {m} is registered (no series before traffic)")
finally:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    etcd.stop()

print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
