"""The lifl client SDK (docs/client.md): talk to a gateway over HTTP or gRPC, convert models to
and from the update format, and take part in synchronous FL rounds.

- ``Gateway`` wraps one connection. Blobs are sent without extra copies: over HTTP the body
  is written straight from the caller's buffer, and over gRPC the HTTP/2 frames point into it
  too (``lifl.client.grpcwire``; other calls use grpcio). Errors come
  back as the ``LiflError`` subclasses the gateway raised, with code, message and ``version``.
  Calls survive faults: a broken connection is replaced, and what is safe to retry is retried
  with bounded exponential back-off, never sooner than the gateway's Retry-After
  (``RetryPolicy``; the rules are in docs/client.md, "Faults"). ``push_file`` sends a large
  update from a file through a resumable upload that goes on where a broken connection left
  it, and ``download_model`` resumes a model's download with an HTTP range.
- ``to_blob`` / ``from_blob`` convert torch ``state_dict``s and dicts of numpy arrays; tensors
  are read in place (CPU tensors are not copied before serialising) and come back as views
  of the received blob.
- ``Participant`` is one client's side of a round: lease, pull, train (heartbeats keep the
  lease meanwhile), push; it reports 409s as "retrain" and gives its lease back when a round
  fails.

The SDK depends on lifl's core modules only (the update format, errors, the wire formats) and
installs without the server's dependencies: ``lifl/client/pyproject.toml`` builds it as the
``lifl-client`` wheel, which needs numpy; its ``grpc`` extra adds what ``protocol="grpc"``
needs, its ``torch`` extra what torch tensors need.
"""

from lifl.client.blobs import from_blob, to_blob
from lifl.client.gateway import DEFAULT_RETRY, NO_RETRY, TOKEN_ENV, ConnectionLost, Gateway, RetryPolicy
from lifl.client.participant import Participant, RoundResult
from lifl.client.split import SplitJob
from lifl.net.tls import ClientTls

__all__ = ["DEFAULT_RETRY", "NO_RETRY", "TOKEN_ENV", "ClientTls", "ConnectionLost", "Gateway", "Participant", "RetryPolicy", "SplitJob",
           "RoundResult", "from_blob", "to_blob"]
