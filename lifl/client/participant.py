"""One client's side of synchronous FL rounds: lease, pull, train (heartbeats keep the lease
meanwhile), push, through whichever gateway the cluster assigns."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lifl import errors
from lifl import format as fmt
from lifl.client.blobs import from_blob, to_blob
from lifl.client.gateway import DEFAULT_RETRY, Gateway, RetryPolicy
from lifl.net.tls import ClientTls, client_settings


@dataclass
class RoundResult:
    outcome: str  # "accepted", "stale" (pull and retrain), or "no_slot" (the round is full or closed); secure rounds' others: Participant._run_secure_round
    version: int  # the version trained from (accepted), or the current one


class Participant:
    """One client's side of synchronous FL rounds.

    ``run_round(train)`` asks any gateway which node to use this round (the cluster's placement)
    and talks to that node's gateway: it takes a lease, pulls the current model, calls
    ``train(state, version)`` (which returns the trained state and its sample count) while a
    thread heartbeats the lease, and pushes the update. Calls are retried by ``retry``
    (back-pressure, unreachable gateway: docs/client.md, "Faults"); a round that fails after
    taking its lease gives the lease back before the error propagates. ``address`` is the
    gateway it starts from (and falls back to). ``tls`` is as ``Gateway``'s, and holds for every
    gateway the participant is sent to. ``token`` is the client's (default: LIFL_TOKEN);
    ``client`` names the client only when an operator's token acts as one.
    """

    def __init__(self, address: str, job: str, client: str | None = None, *, protocol: str = "http",
                 as_torch: bool = False, retry: RetryPolicy = DEFAULT_RETRY, token: str | None = None,
                 tls: ClientTls | bool | None = None, secure: bool = False) -> None:
        self.address, self.job, self.client, self.protocol = address, job, client, protocol
        self.secure = secure
        self.tls = client_settings(address, tls)[1]  # for every gateway it talks to: assigned ones too
        self.as_torch = as_torch
        self.retry = retry
        self.token = token
        self.bootstrap = self.connect(address, retry)
        self.gateway = self.bootstrap
        self.gateway_address = address  # the assigned node's, once known

    def connect(self, address: str, retry: RetryPolicy) -> Gateway:
        """A connection of this participant's to the gateway at ``address``."""
        return Gateway(address, self.protocol, retry=retry, token=self.token, tls=self.tls)

    def close(self) -> None:
        if self.gateway is not self.bootstrap:
            self.gateway.close()
        self.bootstrap.close()

    def _follow_assignment(self) -> None:
        """Use the gateway of the node assigned for this round (the one it had, if unchanged)."""
        try:
            assigned = self.bootstrap.assignment(self.job, self.client)[self.protocol]
        except (errors.LiflError, OSError):
            return  # an older gateway, or none reachable: keep the one in use
        if assigned != self.gateway_address:
            if self.gateway is not self.bootstrap:
                self.gateway.close()
            self.gateway = self.connect(assigned, self.retry)
            self.gateway_address = assigned

    def run_round(self, train: Callable[[dict[str, Any], int], tuple[Mapping[str, Any], int]]) -> RoundResult:
        if self.secure:
            return self._run_secure_round(train)
        self._follow_assignment()
        try:
            lease = self.gateway.take_lease(self.job, self.client)
        except errors.Conflict as e:  # round full or closed: try again for the next one
            return RoundResult("no_slot", e.extra.get("version", -1))
        try:
            version, blob = self.gateway.model(self.job)
            state = from_blob(blob, as_torch=self.as_torch)
            with _Heartbeats(lambda retry: self.connect(self.gateway_address, retry), self.job, lease, self.retry):
                trained, samples = train(state, version)
            self.gateway.push(self.job, to_blob(trained), client=self.client, samples=samples, base_version=version,
                              lease=lease["lease"])
            return RoundResult("accepted", version)  # the update took the lease's place
        except errors.Conflict as e:
            self._give_back(lease)
            return RoundResult("stale", e.extra.get("version", -1))
        except Exception as e:
            self._give_back(lease, e)
            raise

    def _run_secure_round(self, train: Callable[[dict[str, Any], int], tuple[Mapping[str, Any], int]]) -> RoundResult:
        """A secure job's round (docs/secure-aggregation.md): pull, train, then every stage of the
        round by itself; the update leaves this process masked. Its place in the round is its
        advertisement (no lease). Outcomes beyond ``run_round``'s: "abandoned", "moved_on",
        "left_out" (a stage closed without this client), "timeout", "inconsistent" (it refused the
        server's unmask request: the consistency check failed)."""
        from lifl.client.secure import RoundOver, run_secure_round  # the secure extra: cryptography

        self._follow_assignment()
        version, blob = self.gateway.model(self.job)
        spec = fmt.parse_layout(blob).spec()
        trained, samples = train(from_blob(blob, as_torch=self.as_torch), version)
        try:
            run_secure_round(self.gateway, self.job, self.client, from_blob(to_blob(trained)), samples, spec, version,
                             base=from_blob(blob))
        except RoundOver as e:
            return RoundResult(e.outcome, version)
        except errors.Conflict as e:  # the round enrolled its goal of clients, or moved on: the next one
            return RoundResult("no_slot", e.extra.get("version", -1))
        return RoundResult("accepted", version)

    def _give_back(self, lease: dict[str, Any], failure: Exception | None = None) -> None:
        """Release a lease this round will not use, so that its place goes to another client now
        rather than when it lapses: best-effort, retried for at most the lease's lifetime (later it
        has lapsed anyway), on a connection of its own (the round's may be what failed). If it
        cannot be released, ``failure`` (the round's error) says so."""
        retry = dataclasses.replace(self.retry, max_elapsed_s=min(self.retry.max_elapsed_s, lease["ttl_s"]))
        gateway = self.connect(self.gateway_address, retry)
        try:
            gateway.release_lease(self.job, lease["lease"])
        except errors.NotFound:
            pass  # already gone: taken by the push, or lapsed
        except (errors.LiflError, OSError) as e:
            if failure is not None:
                failure.add_note(f"lifl: lease {lease['lease']} could not be released ({e}); it lapses within {lease['ttl_s']} s")
        finally:
            gateway.close()

    def wait_for_version(self, after: int, timeout: float) -> int | None:
        """Wait until the job's version passes ``after`` (the gateway holds each call until it does,
        for at most ``MAX_VERSION_WAIT_S``), or ``timeout`` seconds; returns the version seen."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            version = self.gateway.wait_for_version(self.job, after, left)["version"]
            if version is not None and version > after or time.monotonic() >= deadline:
                return version


class _Heartbeats:
    """Renews a lease every third of its lifetime, on a connection of its own, while training.
    A renewal is retried until the next one is due; one that fails for good is left to the next
    (if the lease lapses meanwhile, the push finds out whether a place is still free)."""

    def __init__(self, connect: Callable[[RetryPolicy], Gateway], job: str, lease: dict[str, Any], retry: RetryPolicy) -> None:
        every = max(0.05, lease["ttl_s"] / 3)
        self._connect = connect
        self._args = (job, lease["lease"], every)
        self._retry = dataclasses.replace(retry, max_elapsed_s=min(retry.max_elapsed_s, every))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        job, lease, every = self._args
        gateway = self._connect(self._retry)
        try:
            while not self._stop.wait(every):
                try:
                    gateway.heartbeat(job, lease)
                except errors.NotFound:
                    return  # lapsed: the push will find out whether a slot is still free
                except (errors.LiflError, OSError):
                    continue  # the gateway is away: try again when the next renewal is due
        finally:
            gateway.close()

    def __enter__(self) -> _Heartbeats:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
