"""The launch templates agree with the schemas and with Stalwart's exit codes.

Kubernetes: every object in deploy/kubernetes/ is validated against the official schemas, strictly (an
unknown field is an error, as with `kubectl apply --validate=strict`): core objects and the JobSet's Job
template by ``kubernetes-validate`` (upstream Kubernetes schemas), the JobSet itself by the CRD's own
openAPIV3Schema (tests/data, from kubernetes-sigs/jobset v0.9.1). Slurm: the sbatch template's
requeue decisions name the documented exit codes (its behaviour runs in test_launch_slurm_e2e.py).
"""

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest

from stalwart.ft.detect import EXIT_CRASH_LOOP, EXIT_RESTART_BUDGET, EXIT_USER_ERROR

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
K8S_VERSION = "1.33.0"
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")


def _strict(schema):
    """A CRD schema as the API server applies it with strict field validation: unknown fields are errors
    (except where the schema preserves them)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


JOBSET_SCHEMA = _strict(json.loads((REPO / "tests" / "data" / "jobset-v0.9.1.schema.json").read_text())["schema"])


def validate(doc):
    """Raise on the first schema error of one manifest object."""
    if doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2":
        jsonschema.validate(doc, JOBSET_SCHEMA)
        for rj in doc["spec"]["replicatedJobs"]:
            job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"]}, **rj["template"]}
            kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _docs():
    out = []
    for path in sorted((REPO / "deploy" / "kubernetes").glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def test_kubernetes_manifests_validate_against_the_official_schemas():
    docs = _docs()
    assert {d["kind"] for d in docs} == {"JobSet", "PersistentVolumeClaim"}
    for d in docs:
        validate(d)


def test_a_misspelt_or_mistyped_field_is_rejected():
    js = next(d for d in _docs() if d["kind"] == "JobSet")
    for path, value in ((("spec", "failurePolicy", "maxRestart"), 5),                       # JobSet CRD field
                        (("spec", "failurePolicy", "rules", 0, "action"), "Requeue"),        # not in the enum
                        (("spec", "replicatedJobs", 0, "template", "spec", "backofLimit"), 0),  # Job field
                        (("spec", "replicatedJobs", 0, "template", "spec", "podFailurePolicy", "rules", 0,
                          "onExitCodes", "values"), "2")):                                  # wrong type
        bad = copy.deepcopy(js)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            validate(bad)


def test_jobset_exit_code_semantics_and_rendezvous_agree_with_stalwart():
    js = next(d for d in _docs() if d["kind"] == "JobSet")
    rj = js["spec"]["replicatedJobs"][0]
    job = rj["template"]["spec"]
    pod = job["template"]["spec"]
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] == 0
    fail = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail[0]["onExitCodes"]["containerName"] == "trainer"
    assert set(fail[0]["onExitCodes"]["values"]) == {EXIT_USER_ERROR, EXIT_CRASH_LOOP}  # never restarted
    assert EXIT_RESTART_BUDGET not in fail[0]["onExitCodes"]["values"]  # 75: the JobSet restarts (requeue)
    assert any(r["action"] == "Ignore" and r["onPodConditions"][0]["type"] == "DisruptionTarget"
               for r in job["podFailurePolicy"]["rules"])
    assert js["spec"]["failurePolicy"]["rules"][0] == {"name": "user-error-or-crash-loop", "action": "FailJobSet",
                                                       "onJobFailureReasons": ["PodFailurePolicy"]}
    args = dict(a.split("=", 1) for a in trainer["command"] if a.startswith("--") and "=" in a)
    host, port = args["--rdzv-endpoint"].rsplit(":", 1)
    assert host == f"{js['metadata']['name']}-{rj['name']}-0-0.{js['spec']['network']['subdomain']}"  # first pod
    assert int(port) in [p["containerPort"] for p in trainer["ports"]]
    lo, hi = map(int, args["--nnodes"].split(":"))
    assert lo == hi <= job["parallelism"] == job["completions"]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == int(args["--nproc-per-node"])


def test_sbatch_template_requeues_on_the_documented_exit_codes():
    text = (REPO / "deploy" / "slurm" / "stalwart.sbatch").read_text()
    assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0
    cases = dict(re.findall(r"^\s+(\d+)\)\s+(\w+)", text, re.M))
    assert cases[str(EXIT_RESTART_BUDGET)] == "requeue"
    assert cases[str(EXIT_CRASH_LOOP)] == "echo" and cases[str(EXIT_USER_ERROR)] == "echo"
    for flag in ("--requeue", "--signal=B:USR1@", "--open-mode=append"):
        assert f"#SBATCH {flag}" in text
    assert "scontrol show hostnames" in text and "--rdzv-backend=c10d" in text and "SPARE_NODES" in text
