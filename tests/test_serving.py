"""vllm_lab.serving and the playbooks on this machine: failure classification on real log samples,
local serve -> /health -> stop through the playbooks, zero changes on a second run, secrets kept out."""

from __future__ import annotations

import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.fleet import TWIN_MODEL, kill_instances, lab_source_snapshot, shared_site_vars
from tests.support.processes import free_port, process_table
from vllm_lab import backends, serving
from vllm_lab.serving import ServeError, classify_failure

LOCAL = serving.REPO_ROOT / "inventory" / "local.yml"

# --- log samples in vLLM's own wording (0.2x V1 engine; the twin copies it) -------------------------
OOM_CUDA = """\
(EngineCore_DP0 pid=5121) ERROR 11-30 01:02:03 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=5121) ERROR 11-30 01:02:03 [core.py:708]   File "/opt/vllm/lib/python3.12/site-packages/vllm/model_executor/model_loader/base_loader.py", line 49, in load_model
(EngineCore_DP0 pid=5121) ERROR 11-30 01:02:03 [core.py:708] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1002.00 MiB. GPU 0 has a total capacity of 139.81 GiB of which 512.00 MiB is free.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
OOM_CACHE = """\
(EngineCore pid=17806) ERROR 11-30 02:11:53 [core.py:1071] EngineCore failed to start.
(EngineCore pid=17806) ERROR 11-30 02:11:53 [core.py:1071] ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""
OOM_KV = """\
(EngineCore_DP0 pid=811) ERROR [core.py:708] ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV cache is needed, which is larger than the available KV cache memory (9.54 GiB). Based on the available memory, the estimated maximum model length is 78128. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.
"""
REFUSED_ARGPARSE = """\
usage: vllm serve [model_tag] [options]
vllm serve: error: unrecognized arguments: --max-num-seq 64
"""
REFUSED_CHOICE = """\
vllm serve: error: argument --kv-cache-dtype: invalid choice: 'fp4' (choose from 'auto', 'bfloat16', 'fp8', 'fp8_e4m3', 'fp8_e5m2')
"""
REFUSED_PYDANTIC = """\
pydantic_core._pydantic_core.ValidationError: 1 validation error for EngineArgs
max_num_seqs
  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=0, input_type=int]
"""
REFUSED_VALUE = """\
(APIServer pid=99) ValueError: max_num_batched_tokens (2048) is smaller than max_model_len (8192). This effectively limits the maximum sequence length to max_num_batched_tokens and makes vLLM reject longer sequences.
"""
STILL_LOADING = """\
(APIServer pid=4242) INFO 11-30 01:00:00 [api_server.py:1885] vLLM API server version 0.26.0
(EngineCore_DP0 pid=4300) INFO 11-30 01:00:20 [gpu_model_runner.py:2338] Loading model from scratch...
(EngineCore_DP0 pid=4300) INFO 11-30 01:00:31 [backends.py:548] Using cache directory: /root/.cache/vllm/torch_compile_cache
"""
CRASH_SEGV = """\
(EngineCore_DP0 pid=4300) INFO 11-30 01:00:20 [gpu_model_runner.py:2338] Loading model from scratch...
Fatal Python error: Segmentation fault
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
CRASH_ARCH = """\
ValueError: Model architectures ['FooForCausalLM'] are not supported for now. Supported architectures: dict_keys(['LlamaForCausalLM'])
"""


@pytest.mark.parametrize("log_tail,status,cause", [
    (OOM_CUDA, "exited", "oom"), (OOM_CACHE, "exited", "oom"), (OOM_KV, "exited", "oom"),
    (OOM_CACHE, "timeout", "oom"),  # a hung OOM is still an OOM
    (REFUSED_ARGPARSE, "exited", "refused-flag"), (REFUSED_CHOICE, "exited", "refused-flag"),
    (REFUSED_PYDANTIC, "exited", "refused-flag"), (REFUSED_VALUE, "exited", "refused-flag"),
    (STILL_LOADING, "timeout", "start-timeout"), ("", "timeout", "start-timeout"),
    (CRASH_SEGV, "exited", "crashed"), (CRASH_ARCH, "exited", "crashed"), ("", "exited", "crashed"),
])
def test_classify_failure(log_tail, status, cause):
    assert classify_failure(log_tail, status) == cause


@pytest.mark.parametrize("log_tail", [STILL_LOADING, CRASH_SEGV, CRASH_ARCH, REFUSED_ARGPARSE, REFUSED_PYDANTIC])
def test_classify_no_oom_without_oom_words(log_tail):
    assert classify_failure(log_tail, "exited") != "oom"


@pytest.mark.parametrize("log_tail", [OOM_CUDA, OOM_CACHE, OOM_KV, STILL_LOADING, CRASH_SEGV, CRASH_ARCH])
def test_classify_no_refusal_without_flag_words(log_tail):
    assert classify_failure(log_tail, "exited") != "refused-flag"


def test_a_failed_starts_evidence_keeps_what_ran_out_of_memory_not_the_advice_after_it():
    advice = " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=" * 5
    log_tail = OOM_CUDA.replace("is free.", "is free." + advice)
    assert serving.oom_line(log_tail).startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 1002.00 MiB")
    assert backends._evidence(log_tail).startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate")
    assert len(backends._evidence(log_tail)) == 300


def test_scrub_and_secret_flags_split():
    assert serving.scrub("key=s3cret and s3cret", ["s3cret", ""]) == "key=*** and ***"
    flags, role_vars = serving._split_secrets({"model": "m", "api_key": "k", "max-num-seqs": 8}, {})
    assert flags == {"model": "m", "max-num-seqs": 8}
    assert role_vars == {"vllm_api_key": "k"}


def test_a_failed_plays_message_is_kept_whole_where_the_callback_wraps_it():
    """Ansible's YAML callback wraps a long assert message over indented lines: the failure kept
    for the lab is the whole message, the flag it names on its last line included."""
    stdout = ("TASK [vllm : VLLM | Assert dev-mode endpoints stay on loopback] ***\n"
              "fatal: [localhost]: FAILED! => \n"
              "    msg: 'localhost: dev mode (VLLM_SERVER_DEV_MODE=1, asked for by runs that reset the\n"
              "      prefix cache) opens /reset_prefix_cache ... or set vllm_dev_mode_network true\n"
              "      for this host in the inventory (a trusted network only).'\n"
              "\n"
              "PLAY RECAP *********\n"
              "localhost : ok=3 changed=0 unreachable=0 failed=1\n")
    failure = serving._play_failure(stdout)
    assert failure.startswith("fatal: [localhost]") and "vllm_dev_mode_network" in failure
    assert "PLAY RECAP" not in failure and "TASK [" not in failure


def test_parse_recap():
    out = ("PLAY RECAP *****\nfleet-1                    : ok=5    changed=0    unreachable=0    "
           "failed=0    skipped=3    rescued=0    ignored=0   \nfleet-3                    : ok=0    "
           "changed=0    unreachable=1    failed=0    skipped=0    rescued=0    ignored=0\n")
    recap = serving.parse_recap(out)
    assert recap["fleet-1"]["changed"] == 0 and recap["fleet-3"]["unreachable"] == 1


# --- through the playbooks, on this machine -------------------------------------------------------
@pytest.fixture(scope="module")
def lab_vars(tmp_path_factory):
    """Extra vars that put one local host's lab in a temp folder, provisioned once for the module."""
    tmp = tmp_path_factory.mktemp("lab")
    vars_ = {**shared_site_vars(), "lab_host_root": str(tmp / "host"),
             "lab_host_lab_source": str(lab_source_snapshot(tmp / "lab-src")),
             "vllm_twin_startup_seconds": 0.3, "vllm_collect_dest": str(tmp / "collected"),
             "vllm_instances": [{"name": "a", "port": free_port(), "gpus": ""},
                                {"name": "b", "port": free_port(), "gpus": "", "flags": {"max-num-seqs": 16}}]}
    run = serving.run_playbook("provision.yml", inventory=LOCAL, extra_vars=vars_)
    assert run.returncode == 0, run.stdout[-3000:]
    yield vars_
    serving.run_playbook("teardown.yml", inventory=LOCAL, extra_vars=vars_)
    kill_instances(tmp)


@pytest.fixture(scope="module")
def ports():
    """A port for each of the other instances the tests below start ("d", "f"), kept for the module."""
    return {"d": free_port(), "f": free_port()}


def _get(url, key=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.integration
@pytest.mark.slow
def test_local_serve_health_stop_idempotent_and_secret_free(lab_vars, monkeypatch):
    key = "sk-lab-test-6b1f0e"
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    flags = {"model": TWIN_MODEL, "max-num-seqs": 32, "api-key": key}
    instances = serving.start(flags, inventory=LOCAL, backend="twin", extra_vars=lab_vars)
    a, b = (i["port"] for i in lab_vars["vllm_instances"])
    assert [(i.host, i.port) for i in instances] == [("localhost", a), ("localhost", b)]
    for inst in instances:
        assert inst.url == f"http://127.0.0.1:{inst.port}"
        assert _get(f"{inst.url}/health") == 200
        assert _get(f"{inst.url}/v1/models") == 401  # --api-key end to end
        assert _get(f"{inst.url}/v1/models", key) == 200
        assert inst.api_key == key and key not in repr(inst)  # for the load generator, never printed

    root = Path(lab_vars["lab_host_root"]) / "serve"
    env_file = root / "conf" / "a.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert key in env_file.read_text()
    for path in [*root.glob("conf/*.yaml"), *root.glob("logs/*"), *root.glob("results/*")]:
        assert key not in path.read_text(errors="replace"), path
    assert "max-num-seqs: 16" in (root / "conf" / "b.yaml").read_text()

    # A second serve with the same flags changes nothing and prints no secret.
    again = serving.run_playbook("serve.yml", inventory=LOCAL, extra_vars={
        **lab_vars, "vllm_flags": {"model": TWIN_MODEL, "max-num-seqs": 32}, "vllm_api_key": key})
    assert again.returncode == 0 and again.changed == 0, again.stdout[-3000:]
    assert key not in again.stdout

    collect = [serving.run_playbook("collect.yml", inventory=LOCAL, extra_vars=lab_vars) for _ in range(2)]
    assert collect[0].returncode == 0 and collect[1].changed == 0
    collected = Path(lab_vars["vllm_collect_dest"]) / "localhost"
    assert (collected / "logs" / "a.log").exists() and not list(collected.rglob("*.env"))

    pids = [int((root / "run" / f"{n}.pid").read_text().split()[0]) for n in ("a", "b")]
    serving.stop(LOCAL, extra_vars=lab_vars)
    for pid in pids:
        assert not _group_alive(pid), pid
    assert _get_refused(instances[0].url)
    second = serving.stop(LOCAL, extra_vars=lab_vars)
    assert second.changed == 0

    prov = serving.run_playbook("provision.yml", inventory=LOCAL, extra_vars=lab_vars)
    assert prov.returncode == 0 and prov.changed == 0, prov.stdout[-3000:]


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is in process group ``pgid``."""
    return any(fields[0] != "Z" and int(fields[2]) == pgid for fields in process_table().values())


def _get_refused(url):
    try:
        _get(f"{url}/health")
    except OSError:
        return True
    return False


@pytest.mark.integration
def test_dev_mode_only_when_asked_and_never_on_the_network_unless_the_inventory_says_so(lab_vars, ports):
    one = {**lab_vars, "vllm_instances": [{"name": "d", "port": ports["d"], "gpus": ""}]}
    env_file = Path(lab_vars["lab_host_root"]) / "serve" / "conf" / "d.env"
    with pytest.raises(ServeError) as err:
        serving.start({"model": TWIN_MODEL}, inventory=LOCAL, backend="twin",
                      extra_vars={**one, "vllm_dev_mode": True, "vllm_listen_host": "0.0.0.0"})
    assert err.value.cause == "refused-config" and "vllm_dev_mode_network" in err.value.log_tail
    assert not env_file.exists()  # refused before anything was written or started
    key = "sk-from-the-vault-7d2c"
    inst = serving.start({"model": TWIN_MODEL}, inventory=LOCAL, backend="twin",
                         extra_vars={**one, "vllm_dev_mode": True, "vllm_api_key": key})[0]
    assert "VLLM_SERVER_DEV_MODE=1" in env_file.read_text() and inst.api_key == key
    pid_file = env_file.parent.parent / "run" / "d.pid"
    old = int(pid_file.read_text().split()[0])
    serving.start({"model": TWIN_MODEL, "max-num-seqs": 8}, inventory=LOCAL, backend="twin", extra_vars=one)
    assert "VLLM_SERVER_DEV_MODE" not in env_file.read_text()
    # The serve alone replaced the running server: the old process group is gone, a new one answers.
    new = int(pid_file.read_text().split()[0])
    assert new != old and not _group_alive(old) and _get(f"{inst.url}/health") == 200
    serving.stop(LOCAL, extra_vars=one)


@pytest.mark.integration
@pytest.mark.parametrize("flags,extra,cause", [
    ({"max-num-seqs": 0}, {}, "refused-flag"),
    ({"max-num-sequences": 64}, {}, "refused-flag"),
    ({"gpu-memory-utilization": 0.11}, {}, "oom"),
    ({}, {"vllm_twin_startup_seconds": 30, "vllm_health_timeout_s": 3}, "start-timeout"),
    ({}, {"crash": True}, "crashed"),
    # A worker's exception under tensor parallelism leaves vLLM alive but wedged (seen on 2 H200s):
    # the wait reads it in the log and does not sit out the 10-minute health timeout.
    ({}, {"wedge": True, "vllm_health_timeout_s": 600}, "crashed"),
])
def test_failed_start_is_classified(lab_vars, ports, tmp_path, flags, extra, cause):
    extra = dict(extra)
    fakes = {"crash": "echo 'Loading model weights...'\nkill -SEGV $$\n",
             "wedge": "echo '(Worker_TP0 pid=1) ERROR [multiproc_executor.py:1007] WorkerProc hit an exception.'\n"
                      "exec sleep 3600\n"}
    for kind, body in fakes.items():
        if extra.pop(kind, False):
            fake = tmp_path / f"vllm-{kind}"
            fake.write_text(f"#!/bin/sh\n{body}")
            fake.chmod(0o755)
            extra["vllm_executable"] = str(fake)
    secret = "sk-must-not-leak-42"
    with pytest.raises(ServeError) as err:
        serving.start({"model": TWIN_MODEL, **flags}, inventory=LOCAL, backend="twin",
                      extra_vars={**lab_vars, **extra, "vllm_api_key": secret,
                                  "vllm_instances": [{"name": "f", "port": ports["f"], "gpus": ""}]})
    assert err.value.cause == cause, err.value.log_tail
    assert err.value.host == "localhost"
    assert secret not in err.value.log_tail and secret not in str(err.value.failures)
    if cause != "crashed":
        assert err.value.log_tail.strip()
    serving.stop(LOCAL, extra_vars=lab_vars)

