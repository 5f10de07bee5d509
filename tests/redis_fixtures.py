"""Real redis-server processes for tests (a pytest plugin: tests/conftest.py lists it).

`RedisServer` runs one redis-server on a free 127.0.0.1 port in its own directory, without
persistence, and can be stopped and started again on the same port. Fixtures:

    redis_server          a fresh server per test
    redis_server_factory  servers with options (password, ACL users, maxmemory, TLS, ...)
    redis_cluster         3 masters, no replicas; one per module, flushed before each test
    RedisClusterServers   also with replicas, and chaos helpers (reshard, failover, kill)
    redis_tls_files       a CA and a server certificate for 127.0.0.1, made with openssl

A missing redis-server binary fails the test (install it; these tests must not vanish silently).
Every server is killed at teardown, and dies with the test process (setpriv --pdeathsig).
"""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from polling import poll_until

try:
    import redis
    from redis.cluster import RedisCluster
except ImportError:  # the rest of the suite still loads; these fixtures fail with the hint
    redis = None  # type: ignore[assignment]

HOST = "127.0.0.1"
START_DEADLINE_S = 20.0


def _binary(name: str) -> str:
    if redis is None:
        pytest.fail("redis-py is not installed: run `pip install -e '.[test]'`", pytrace=False)
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH: run `apt-get install -y redis-server`",
                    pytrace=False)
    return path


def free_port(with_bus: bool = False) -> int:
    """A port free on 127.0.0.1 (and, for a cluster node, its bus port + 10000 too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if not with_bus:
            return port
        if port + 10000 < 65536:
            try:
                with socket.socket() as bus:
                    bus.bind((HOST, port + 10000))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port pair found")


def _launcher() -> list[str]:
    """A prefix that makes the server die with this process (a killed pytest leaves nothing
    behind): util-linux's setpriv sets the parent-death signal, then execs the server. (Not a
    preexec_fn: that runs Python between fork and exec, unsafe once threads exist.)"""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL"] if setpriv else []


_LIVE: set[RedisServer] = set()  # killed at exit too, should a fixture's teardown not run


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_LIVE):
        server.stop()


def wait_for(cond: Callable[[], bool], what: str, deadline_s: float = START_DEADLINE_S) -> None:
    """Poll cond (5 ms apart: a redis-server process gets ready) until true, or fail."""
    poll_until(cond, what, deadline_s, interval_s=0.005)


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path


class RedisServer:
    """One redis-server. `start()` waits until it answers PING; `stop()` kills it and waits."""

    def __init__(self, directory: Path, *, port: int | None = None, password: str | None = None,
                 acl_users: tuple[str, ...] = (), maxmemory: str | None = None,
                 maxmemory_policy: str | None = None, tls: TlsFiles | None = None,
                 cluster: bool = False, extra_args: tuple[str, ...] = ()) -> None:
        self.binary = _binary("redis-server")
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_port(with_bus=cluster)
        self.password = password
        self.tls = tls
        self.cluster = cluster
        self.log = self.dir / "redis.log"
        args = ["--bind", HOST, "--protected-mode", "yes", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--logfile", str(self.log), "--daemonize", "no"]
        if tls is None:
            args += ["--port", str(self.port)]
        else:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(tls.server_cert), "--tls-key-file",
                     str(tls.server_key), "--tls-ca-cert-file", str(tls.ca_cert),
                     "--tls-auth-clients", "no"]
        if password is not None:
            args += ["--requirepass", password]
        for rule in acl_users:  # e.g. "alice on >secret ~* &* +@all"
            args += ["--user", *rule.split()]
        if maxmemory is not None:
            args += ["--maxmemory", maxmemory]
        if maxmemory_policy is not None:
            args += ["--maxmemory-policy", maxmemory_policy]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "5000"]
        self.args = args + list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{HOST}:{self.port}/0"

    def client(self, **kw: Any) -> redis.Redis:
        """An admin client (default user, the server's password, TLS if any)."""
        opts: dict[str, Any] = {"host": HOST, "port": self.port, "password": self.password,
                                "socket_timeout": 5.0, "socket_connect_timeout": 5.0}
        if self.tls is not None:
            opts.update(ssl=True, ssl_ca_certs=str(self.tls.ca_cert))
        opts.update(kw)
        return redis.Redis(**opts)

    def start(self) -> RedisServer:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen([*_launcher(), self.binary, *self.args], cwd=self.dir,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _LIVE.add(self)
        probe = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            wait_for(lambda: self._answers(probe), f"redis-server on port {self.port}")
        except BaseException:
            self.stop()
            raise
        finally:
            probe.close()
        return self

    def _answers(self, probe: redis.Redis) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise AssertionError(f"redis-server exited ({self.proc.returncode}): {err}{log}")
        try:
            return bool(probe.ping())
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def stop(self) -> None:
        """Kill (SIGKILL: a crash, nothing flushed) and wait for the exit; the port is free."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        _LIVE.discard(self)
        if proc.stderr:
            proc.stderr.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class RedisClusterServers:
    """One Redis Cluster on 127.0.0.1: `masters` masters (all slots assigned), each with
    `replicas` replicas. Chaos helpers: `reshard` (redis-cli, in the background), `failover`
    (CLUSTER FAILOVER on a replica), `kill` (SIGKILL), `wait_ok`."""

    def __init__(self, directory: Path, masters: int = 3, replicas: int = 0,
                 node_timeout_ms: int = 5000) -> None:
        extra = ("--cluster-node-timeout", str(node_timeout_ms))
        self.nodes = [RedisServer(directory / f"node{i}", cluster=True, extra_args=extra)
                      for i in range(masters * (1 + replicas))]
        self.replicas = replicas
        self._admins: dict[int, redis.Redis] = {}  # one admin connection per node, kept

    @property
    def url(self) -> str:
        return self.nodes[0].url  # any node: the client learns the others

    def start(self) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            done = subprocess.run(
                [_binary("redis-cli"), "--cluster", "create",
                 *[f"{HOST}:{n.port}" for n in self.nodes], "--cluster-replicas",
                 str(self.replicas), "--cluster-yes"], capture_output=True, text=True,
                timeout=60, check=False)
            assert done.returncode == 0, f"redis-cli --cluster create: {done.stdout}{done.stderr}"
            self.wait_ok()
            wait_for(lambda: all(self.admin(n).info("replication").get("master_link_status",
                                                                        "up") == "up"
                                 for n in self.nodes), "every replica in sync")
        except BaseException:
            self.stop()
            raise
        return self

    def admin(self, node: RedisServer) -> redis.Redis:
        """The node's admin client (one connection, kept: chaos tests count connections)."""
        if node.port not in self._admins:
            self._admins[node.port] = node.client(single_connection_client=True)
        return self._admins[node.port]

    def running(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.running]

    def wait_ok(self, deadline_s: float = START_DEADLINE_S) -> None:
        """cluster_state:ok on every running node, and they agree on who serves each slot."""
        def ok() -> bool:
            nodes = self.running()
            if not all(self.admin(n).cluster("INFO")["cluster_state"] == "ok" for n in nodes):
                return False
            views = {tuple(sorted((r[0], r[1], r[2][1]) for r in
                                  self.admin(n).execute_command("CLUSTER", "SLOTS")))
                     for n in nodes}
            return len(views) == 1
        wait_for(ok, "cluster_state:ok and one slot map on every node", deadline_s)

    def node_id(self, node: RedisServer) -> str:
        raw = self.admin(node).execute_command("CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def role(self, node: RedisServer) -> str:
        return str(self.admin(node).info("replication")["role"])

    def masters(self) -> list[RedisServer]:
        return [n for n in self.running() if self.role(n) == "master"]

    def replica_of(self, master: RedisServer) -> RedisServer:
        mid = self.node_id(master)
        for n in self.running():
            if n is not master and self.role(n) == "slave" and _master_id(self.admin(n)) == mid:
                return n
        raise AssertionError(f"no replica of port {master.port}")

    def master_of_slot(self, slot: int) -> RedisServer:
        for start, end, master, *_ in self.admin(self.running()[0]).execute_command(
                "CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(master[1]))
        raise AssertionError(f"slot {slot} is not served")

    def reshard(self, source: RedisServer, target: RedisServer,
                slots: int) -> subprocess.Popen[str]:
        """redis-cli --cluster reshard in the background (its output in `reshard.log`: a pipe
        nobody reads would fill and stop it)."""
        log = (self.nodes[0].dir.parent / "reshard.log").open("w")
        return subprocess.Popen(
            [_binary("redis-cli"), "--cluster", "reshard", f"{HOST}:{source.port}",
             "--cluster-from", self.node_id(source), "--cluster-to", self.node_id(target),
             "--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline", "10"],
            stdout=log, stderr=subprocess.STDOUT, text=True)

    def failover(self, replica: RedisServer) -> None:
        """CLUSTER FAILOVER on a replica: it becomes its master's master (coordinated)."""
        assert self.admin(replica).execute_command("CLUSTER", "FAILOVER") in (b"OK", "OK", True)

    def kill(self, node: RedisServer) -> None:
        admin = self._admins.pop(node.port, None)
        if admin is not None:
            admin.close()
        node.stop()

    def connections_received(self) -> int:
        """total_connections_received summed over the running nodes."""
        return sum(int(self.admin(n).info("stats")["total_connections_received"])
                   for n in self.running())

    def client(self) -> RedisCluster:
        return RedisCluster(host=HOST, port=self.nodes[0].port, socket_timeout=5.0)

    def flush(self) -> None:
        for node in self.masters():
            self.admin(node).flushall()

    def stop(self) -> None:
        for admin in self._admins.values():
            admin.close()
        self._admins.clear()
        for node in self.nodes:
            node.stop()


def _master_id(admin: redis.Redis) -> str:
    """The id of the master a replica replicates (from its own CLUSTER NODES line)."""
    raw = admin.execute_command("CLUSTER", "NODES")
    text = raw.decode() if isinstance(raw, bytes) else raw
    if isinstance(text, dict):  # redis-py may parse the reply
        for info in text.values():
            if "myself" in info.get("flags", ""):
                return str(info.get("master_id", ""))
        return ""
    for line in str(text).splitlines():
        fields = line.split()
        if len(fields) > 3 and "myself" in fields[2]:
            return fields[3]
    return ""


def make_tls_files(directory: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost (openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl not found: run `apt-get install -y openssl`", pytrace=False)
    directory.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for cmd in (
        ["req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
         "-subj", "/CN=kvport test CA"],
        ["req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.cnf"],
    ):
        done = subprocess.run(["openssl", *cmd], cwd=directory, capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, f"openssl {cmd[0]}: {done.stderr}"
    return TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key")


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """make(start=True, **RedisServer options) -> a server, killed at teardown."""
    servers: list[RedisServer] = []

    def make(start: bool = True, **options: Any) -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(servers)}", **options)
        servers.append(server)
        return server.start() if start else server

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_server_factory()


@pytest.fixture(scope="module")
def _redis_cluster_module(tmp_path_factory: pytest.TempPathFactory,
                          ) -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(_redis_cluster_module: RedisClusterServers) -> RedisClusterServers:
    _redis_cluster_module.flush()
    return _redis_cluster_module


@pytest.fixture(scope="session")
def redis_tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("redis-tls"))
