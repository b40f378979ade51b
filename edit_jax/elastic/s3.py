"""The exchange in object storage over the S3 API (AWS S3, or an S3-compatible store with
conditional writes): ``sync.exchange.url = "s3://BUCKET/PREFIX"``.

Each key is one object under ``PREFIX/``. S3 makes a PUT whole or absent (a reader never sees half
an object) and reads strongly consistent, so ``put`` is one PUT. ``create`` is a conditional PUT
(``If-None-Match: *``): the store refuses it with 412 when the object exists, which makes the
create exclusive between workers on different machines without a lock service. Stores without
conditional writes ignore the header, and ``create`` would not be exclusive there: use one that has
them (AWS S3 since August 2024; ``moto`` >= 5.0.15, which the tests serve; other stores: see their
documentation for ``If-None-Match`` on PutObject).

boto3 (``pip install 'edit-jax[s3]'``) is imported when an exchange is opened, not with this module.
Credentials come from boto3's usual chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a
profile, an instance role); ``AWS_MAX_ATTEMPTS`` sets its retries.
"""

from __future__ import annotations

import os
import random
import time
from urllib.parse import parse_qs, urlsplit

from edit_jax.elastic.keys import ExchangeError, _check_key

# S3 answers 409 ConditionalRequestConflict when a conditional PUT races another write of the same
# key that has not settled; its documentation says to retry. These bound that loop.
_CONFLICT_TRIES = 8
_CONFLICT_BACKOFF_S = 0.05
# What may pass by itself (``patience.py`` retries it): the store unreachable or slow, or busy.
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError",
                "ConnectionError", "HTTPClientError", "ProxyConnectionError")
_BUSY = ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
         "ServiceUnavailable", "InternalError", "RequestLimitExceeded", "TooManyRequestsException")


def _boto(url: str):
    """boto3 and botocore's errors, or an ExchangeError saying what to install."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError as e:
        raise ExchangeError(
            f"sync.exchange.url {url!r}: an s3:// exchange needs boto3, which is not installed ({e}): "
            "pip install 'edit-jax[s3]'"
        ) from e
    return boto3, Config, BotoCoreError, ClientError


def _status(err) -> int:
    return int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(err) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def _resent(err) -> bool:
    """Whether botocore sent the request more than once (after a lost or failed answer)."""
    return int(err.response.get("ResponseMetadata", {}).get("RetryAttempts") or 0) > 0


def _is_key(name: str) -> bool:
    try:
        return bool(_check_key(name))
    except ValueError:
        return False


def parse_s3_url(url: str) -> tuple[str, str, str | None]:
    """``s3://bucket/some/prefix?endpoint=URL`` -> (bucket, prefix ending in "/" or "", endpoint)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ExchangeError(f"sync.exchange.url: expected s3://BUCKET/PREFIX, got {url!r}")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"endpoint"})
    if unknown:
        raise ExchangeError(f"sync.exchange.url {url!r}: unknown option(s) {unknown}; the only one is ?endpoint=URL")
    endpoint = query["endpoint"][-1] if "endpoint" in query else None
    if endpoint is not None and urlsplit(endpoint).scheme not in ("http", "https"):
        raise ExchangeError(f"sync.exchange.url {url!r}: endpoint must be an http(s):// URL, got {endpoint!r}")
    prefix = parts.path.strip("/")
    if prefix:
        try:
            _check_key(prefix)
        except ValueError:
            raise ExchangeError(f"sync.exchange.url {url!r}: malformed prefix {prefix!r}") from None
    return parts.netloc, prefix + "/" if prefix else "", endpoint


class S3Exchange:
    """The exchange as the objects under ``s3://bucket/prefix/``. One client, shared by threads
    (boto3's clients are thread-safe; its sessions are not, so each exchange has its own)."""

    poll_s = 0.5  # how often a waiting worker asks (each poll is a few requests)

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        url: str | None = None,
        page_size: int = 1000,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = url or f"s3://{bucket}/{self.prefix}"
        boto3, Config, self._BotoCoreError, self._ClientError = _boto(self.url)
        self.endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
        self.region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.page_size = page_size
        # Retries: botocore's standard mode (5xx, throttling, dropped connections), count from
        # AWS_MAX_ATTEMPTS (default 3). A short connect timeout: a wrong endpoint fails in seconds.
        config = Config(retries={"mode": "standard"}, connect_timeout=10, read_timeout=120)
        session = boto3.session.Session(region_name=self.region)
        try:
            self._client = session.client("s3", endpoint_url=self.endpoint, config=config)
            self._client.head_bucket(Bucket=bucket)
        except (self._BotoCoreError, self._ClientError) as e:
            raise self._error("open the bucket", None, e) from e
        except ValueError as e:  # botocore's "Invalid endpoint", a bad region name
            raise ExchangeError(f"sync.exchange.url {self.url!r}: malformed endpoint or region "
                                f"({self._where()}): {e}") from None

    @classmethod
    def from_url(cls, url: str) -> S3Exchange:
        """``s3://bucket/prefix[?endpoint=http://host:port]``; without ``endpoint``, the
        ``AWS_ENDPOINT_URL`` environment variable, else AWS itself."""
        bucket, prefix, endpoint = parse_s3_url(url)
        return cls(bucket, prefix, endpoint=endpoint, url=url)

    def __repr__(self) -> str:
        return f"S3Exchange({self.url!r})"

    def _name(self, key: str) -> str:
        return self.prefix + _check_key(key)

    def _error(self, op: str, key: str | None, err: Exception) -> ExchangeError:
        """A failure as an ExchangeError naming ``sync.exchange.url``, the URL and what to check."""
        what = f"{op} {key!r}" if key is not None else op
        where = f"sync.exchange.url {self.url!r}: cannot {what}"
        if isinstance(err, self._ClientError):
            code, status = _code(err), _status(err)
            # HeadBucket's 404 has no body (code "404"); other calls name NoSuchBucket.
            if code == "NoSuchBucket" or (key is None and code in ("404", "NotFound")):
                return ExchangeError(f"{where}: bucket {self.bucket!r} does not exist (at {self._where()})")
            if status == 403 or code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return ExchangeError(f"{where}: access denied ({code}); check the AWS credentials and the "
                                     f"bucket's policy")
            busy = status >= 500 or status == 429 or code in _BUSY
            return ExchangeError(f"{where}: {code or status}: {err}", transient=busy)
        name = type(err).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            return ExchangeError(f"{where}: no AWS credentials (set AWS_ACCESS_KEY_ID and "
                                 f"AWS_SECRET_ACCESS_KEY, or a profile)")
        if name in _UNREACHABLE:
            return ExchangeError(f"{where}: cannot reach {self._where()}: {err}", transient=True)
        return ExchangeError(f"{where}: {err}", transient=name in ("IncompleteReadError", "ResponseStreamingError"))

    def _where(self) -> str:
        return self.endpoint or f"AWS S3 in {self.region}"

    def put(self, key: str, data: bytes) -> None:
        name = self._name(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=name, Body=bytes(data))
        except (self._BotoCoreError, self._ClientError) as e:
            raise self._error("put", key, e) from e

    def create(self, key: str, data: bytes) -> bool:
        name, data = self._name(key), bytes(data)
        for attempt in range(_CONFLICT_TRIES):
            try:
                self._client.put_object(Bucket=self.bucket, Key=name, Body=data, IfNoneMatch="*")
                return True
            except self._BotoCoreError as e:
                raise self._error("create", key, e) from e
            except self._ClientError as e:
                status, code = _status(e), _code(e)
                if status == 412 or code == "PreconditionFailed":
                    return self._ours_after_resend(key, data, e)
                if not (status == 409 or code == "ConditionalRequestConflict"):
                    raise self._error("create", key, e) from e
                # Another write of the key is in flight. If its object is there, the key is taken;
                # if not (that write failed or was a delete), try again, as S3 asks.
                if self.get(key) is not None:
                    return self._ours_after_resend(key, data, e)
                time.sleep(_CONFLICT_BACKOFF_S * (2**attempt) * (0.5 + random.random()))
        raise ExchangeError(
            f"sync.exchange.url {self.url!r}: cannot create {key!r}: {_CONFLICT_TRIES} conditional writes "
            "in a row met a conflicting write (409 ConditionalRequestConflict)"
        )

    def _ours_after_resend(self, key: str, data: bytes, err) -> bool:
        """The conditional PUT was refused because the key exists. If botocore had re-sent it (the
        first answer lost), the object may be this call's own first attempt: then it is ours when
        it holds exactly our bytes (writers put their identity in what they create, so another
        writer's object differs)."""
        return _resent(err) and self.get(key) == data

    def get(self, key: str) -> bytes | None:
        name = self._name(key)
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=name)
            return answer["Body"].read()  # botocore raises if fewer bytes than Content-Length came
        except self._ClientError as e:
            if _code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._error("get", key, e) from e
        except self._BotoCoreError as e:
            raise self._error("get", key, e) from e

    def list(self, prefix: str) -> list[str]:
        if prefix.startswith("/"):
            raise ValueError(f"exchange list: expected a relative key prefix, got {prefix!r}")
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix, PaginationConfig={"PageSize": self.page_size}
        )
        keys = []
        try:
            for page in pages:
                keys += [obj["Key"][len(self.prefix):] for obj in page.get("Contents", ())]
        except (self._BotoCoreError, self._ClientError) as e:
            raise self._error("list", prefix, e) from e
        # Only what get() accepts: not a console's "folder/" marker nor a name the key rule refuses.
        return sorted(k for k in keys if _is_key(k))

    def delete(self, key: str) -> None:
        name = self._name(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=name)  # no error when absent
        except (self._BotoCoreError, self._ClientError) as e:
            raise self._error("delete", key, e) from e


__all__ = ["S3Exchange", "parse_s3_url"]
