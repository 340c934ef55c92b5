"""One frozen settings value: the environment, read once, and the tuning knobs."""

import ast
import dataclasses
import pathlib

import pytest

import tpu_ckpt as tc
from tpu_ckpt import cluster, relay, storage
from tpu_ckpt.settings import Settings, configure, settings

PACKAGE = pathlib.Path(tc.__file__).parent


@pytest.fixture
def restored_settings():
    """Puts back whatever settings the process had, after a test changes them."""
    previous = configure(None)
    yield
    configure(previous)


def test_the_environment_is_read_once_at_first_use(monkeypatch, restored_settings):
    monkeypatch.setenv("TPU_CKPT_RELAY_HOST", "10.0.0.7")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "")  # empty: unset
    first = settings()
    assert (first.relay_host, first.aws_endpoint_url) == ("10.0.0.7", None)
    monkeypatch.setenv("TPU_CKPT_RELAY_HOST", "10.0.0.8")
    assert settings() is first and cluster.relay_host() == "10.0.0.7"
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.relay_host = "10.0.0.9"  # type: ignore[misc]


def test_environment_variables_map_to_fields():
    value = Settings.from_environment({"TPU_CKPT_RELAY_HOST": "h", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000"})
    assert value == Settings(relay_host="h", aws_endpoint_url="http://127.0.0.1:9000")
    assert Settings.from_environment({}) == Settings()


@pytest.mark.parametrize(("text", "ports"), [("50100-50199", (50100, 50199)), (" 50100 ", (50100, 50100)), ("", None)])
def test_the_relay_port_range_comes_from_the_environment(text, ports):
    assert Settings.from_environment({"TPU_CKPT_RELAY_PORTS": text}).relay_ports == ports


@pytest.mark.parametrize("text", ["50100:50199", "high", "50199-50100", "0-10", "65000-70000"])
def test_a_malformed_relay_port_range_names_the_variable(text):
    with pytest.raises(ValueError, match="TPU_CKPT_RELAY_PORTS"):
        Settings.from_environment({"TPU_CKPT_RELAY_PORTS": text})


def test_relay_socket_buffers_may_be_left_to_the_kernel():
    assert Settings(relay_socket_buffer_bytes=0).relay_socket_buffer_bytes == 0


@pytest.mark.parametrize(
    "knob",
    [
        "io_threads", "writes_in_flight", "read_batch_bytes", "object_bytes", "object_reads_in_flight",
        "relay_heartbeat_seconds", "relay_connect_seconds",
    ],
)
def test_a_knob_must_be_positive(knob):
    with pytest.raises(ValueError, match=f"Settings.{knob} must be positive"):
        Settings(**{knob: 0})


def test_only_the_settings_module_reads_the_environment():
    readers = set()
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                readers.add(path.name)
    assert readers == {"settings.py"}


def test_the_relay_follows_its_connection_knob(tmp_path, restored_settings):
    configure(Settings(relay_connections=1))
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=0, accepts={"x"}.__contains__)
    try:
        with relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0) as client:
            client.write("x", [b"1"]).result()  # one connection, which the server accepted
            with pytest.raises(tc.CheckpointError, match="serves at most 1 at once"):
                relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0)
    finally:
        server.close()
        store.close()


@pytest.mark.parametrize("text", ["1e-300", "1e-9", "0.001"])
def test_a_request_pace_so_slow_one_request_would_wait_hours_is_refused_naming_the_variable(text):
    with pytest.raises(
        ValueError, match="TPU_CKPT_OBJECT_REQUESTS_PER_SECOND\\) must be 0 \\(no limit\\) or at least 0.01"
    ):
        Settings.from_environment({"TPU_CKPT_OBJECT_REQUESTS_PER_SECOND": text})
    assert Settings.from_environment({"TPU_CKPT_OBJECT_REQUESTS_PER_SECOND": "0.01"}).object_requests_per_second == 0.01
    assert Settings.from_environment({"TPU_CKPT_OBJECT_REQUESTS_PER_SECOND": "0"}).object_requests_per_second == 0
