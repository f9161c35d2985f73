"""A retraining receiver: the control plane's ``retraining.triggered`` webhook in, a new model
version rolled out.

An example of a webhook consumer (docs/webhooks.md), small enough to read and copy. The demo
(``bash deploy/demo.sh``) runs it as the ML team's training pipeline. For each retraining
trigger of ``--model`` it:

1. **receives** the webhook: reads the raw body (at most 256 KiB), checks ``X-MCP-Signature``
   with the shared secret and a timestamp tolerance (300 s), refuses an ``X-MCP-Delivery`` id it
   has seen (a replay or a retry), appends the trigger to ``WORK/accepted.jsonl`` (fsynced) and
   only then answers 202; the work runs afterwards, one trigger at a time, in a worker thread;
2. **collects** the trigger's hard examples (``POST .../hard-examples/collect``: the devices
   send the inputs their model answered with low confidence) and **downloads** them as a
   dataset (``GET .../hard-examples.npz``, paged, each page written to a temporary file,
   fsynced and renamed) into ``WORK/trigger-N/`` (docs/hard-examples.md);
3. **labels** them. A hard example carries the model's own answer (``predicted``), not the
   truth: training on it would teach the model its own mistakes. A person, or a labelling
   service, has to say what each input shows. This receiver reads those answers from
   ``--annotations``, a JSON object that maps the sha256 of an input's raw bytes (the
   dataset's ``sha256`` column) to its class, and leaves out every example without one. The
   demo writes that file for the images it sends, since it knows what each one shows;
4. **trains** the next version: scikit-learn's MLP on the original training data
   (scikit-learn's 8x8 digits, the split ``mcp_edge.tooling.models.train_digits_mlp`` makes)
   plus three quarters of the labelled hard examples. The last quarter is held out: the log
   line compares the new model on it with what the deployed version answered on the devices;
5. **builds and signs** a bundle (``mcp_edge.shared.bundle``, as ``mcp-bundle build`` and
   ``mcp-bundle sign`` do), signed with ``--publisher-key``; its drift baseline is the original
   training images (the traffic the fleet is meant to see; with the hard examples in it,
   ordinary traffic would look drifted); the version is the next major version above the
   newest published one;
6. **pushes** it (``POST /api/v1/bundles``, as ``mcp-bundle push`` does);
7. **starts its rollout** (``POST /api/v1/rollouts``): ``--rollout-spec``, or a canary on 10 %
   of ``--group`` gated on error rate and latency, then the rest;
8. **acknowledges** the trigger with a note naming the new version and the rollout, and writes
   ``WORK/trigger-N/result.json``.

Each step logs one line starting ``trigger N:``. A failed step that may pass later (the
control plane unreachable, a 5xx) is tried again after 5, 10 and 20 s; one that cannot (no
labelled example, a version conflict) is logged and the trigger is left for a person. A
trigger accepted but not finished (the receiver stopped) is taken up again at the next start;
every step is written so that running it twice does no harm (the version chosen is kept in
``plan.json``, a bundle already published or a rollout already started is reused).

Answers to the webhook: 202 accepted; 200 a delivery seen before, or an event this receiver
does not act on (another type, another model); 400 a malformed body or delivery id; 401 a bad
or stale signature; 413 a body over 256 KiB; 503 the trigger could not be stored (the sender
retries). The API token needs the operator role (collect, push, rollout, acknowledge).

    python deploy/retrain_receiver.py --control-plane http://127.0.0.1:8080 \\
        --token-file trainer.token --secret-file webhook.secret --publisher-key publisher.key \\
        --annotations annotations.json --group line-a --work-dir retrain --listen 127.0.0.1:9100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import queue
import re
import signal
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from aiohttp import web

from mcp_edge.controlplane.webhooks import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    verify_signature,
)
from mcp_edge.shared.bundle import build_bundle, sign_bundle
from mcp_edge.shared.bundle.upload import UploadError, upload_bundle
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.fsutil import atomic_write_bytes, fsync_dir
from mcp_edge.shared.signing import read_private_key
from mcp_edge.shared.version import SemVer

log = logging.getLogger("retrain-receiver")

EVENT = "retraining.triggered"
MAX_BODY_BYTES = 256 * 1024
"""Cap on one webhook body (the control plane's events hold at most 64 KiB of data)."""
MAX_JSON_BYTES = 16 * 1024 * 1024
"""Cap on one JSON answer of the control plane, and on the annotations file."""
MAX_DATASET_BYTES = 256 * 1024 * 1024
"""Cap on one downloaded page of hard examples."""
PAGE_LIMIT = 10_000
MAX_EXAMPLES = 100_000
SEEN_DELIVERIES = 100_000
ATTEMPTS = 4
N_FEATURES, N_CLASSES = 64, 10
_DELIVERY = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
DEFAULT_STAGES: list[dict[str, Any]] = [
    {
        "percent": 10,
        "mode": "canary",
        "weight": 0.1,
        "bake_s": 600,
        "gates": [
            {"metric": "error_rate", "threshold": 0.02},
            {"metric": "latency_p95_ratio", "threshold": 1.5},
        ],
    },
    {"percent": 90, "bake_s": 300, "gates": [{"metric": "install_failure_rate", "threshold": 0.1}]},
]

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]


class StepError(Exception):
    """A step of a retraining failed; ``retry`` says whether trying again later may help."""

    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


@dataclass(frozen=True)
class Config:
    """Everything the command line said, read once (files included)."""

    host: str
    port: int
    control_plane: str
    token: str
    secret: bytes
    publisher_key: Path
    model: str
    work_dir: Path
    annotations: Path | None
    rollout: dict[str, Any]
    """The rollout's REST body less ``model`` and ``version``."""
    hidden_units: int
    tolerance_s: float


@dataclass(frozen=True)
class Trigger:
    """A retraining trigger as its webhook named it."""

    id: int
    model: str
    version: str
    delivery: str


# ---------------------------------------------------------------------------- the control plane
class ControlPlane:
    """The few REST calls the receiver makes, with the API token; answers are size-capped."""

    def __init__(self, url: str, token: str, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _request(self, method: str, path: str, body: Any = None) -> urllib.request.Request:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        return urllib.request.Request(self.url + path, data=data, method=method, headers=headers)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One JSON call. Raises StepError (``retry`` for 5xx, 429 and network errors)."""
        try:
            with urllib.request.urlopen(
                self._request(method, path, body), timeout=self.timeout_s
            ) as r:
                raw = r.read(MAX_JSON_BYTES + 1)
        except urllib.error.HTTPError as e:
            raise _http_error(method, path, e) from e
        except OSError as e:
            raise StepError(f"{method} {path}: {e}", retry=True) from e
        if len(raw) > MAX_JSON_BYTES:
            raise StepError(f"{method} {path}: answer over {MAX_JSON_BYTES} bytes", retry=False)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise StepError(f"{method} {path}: the answer is not JSON", retry=False) from e

    def download(self, path: str, dest: Path) -> int:
        """GET ``path`` into ``dest`` (temporary file, fsync, rename); return its size."""
        tmp = dest.with_name(f".{dest.name}.part")
        size = 0
        try:
            with (
                urllib.request.urlopen(self._request("GET", path), timeout=self.timeout_s) as r,
                tmp.open("wb") as f,
            ):
                while chunk := r.read(1 << 20):
                    size += len(chunk)
                    if size > MAX_DATASET_BYTES:
                        raise StepError(f"GET {path}: over {MAX_DATASET_BYTES} bytes", retry=False)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
            fsync_dir(dest.parent)
        except urllib.error.HTTPError as e:
            raise _http_error("GET", path, e) from e
        except OSError as e:
            raise StepError(f"GET {path}: {e}", retry=True) from e
        finally:
            tmp.unlink(missing_ok=True)
        return size


def _http_error(method: str, path: str, e: urllib.error.HTTPError) -> StepError:
    try:
        message = str(json.loads(e.read(4096))["error"])
    except (OSError, ValueError, KeyError, TypeError):
        message = e.reason if isinstance(e.reason, str) else ""
    retry = e.code >= 500 or e.code == 429
    return StepError(f"{method} {path}: HTTP {e.code}: {message[:300]}", retry=retry)


# ---------------------------------------------------------------------------- data and training
@dataclass(frozen=True)
class HardExamples:
    """Hard examples as rows of pixels, with what the deployed model answered for each."""

    inputs: FloatArray
    sha256: list[str]
    predicted: IntArray


def read_dataset(paths: list[Path]) -> HardExamples:
    """The examples of the downloaded ``.npz`` pages whose input is one finite 8x8 image.

    Raises:
        StepError: a page is not an archive of the documented layout.
    """
    rows: list[FloatArray] = []
    hashes: list[str] = []
    answers: list[int] = []
    for path in paths:
        try:
            with np.load(path, allow_pickle=False) as npz:
                hashes_page = [str(h) for h in npz["sha256"]]
                predicted = np.asarray(npz["predicted"], dtype=np.int64)
                if "inputs" in npz.files:
                    inputs = list(npz["inputs"])
                else:
                    inputs = [npz[f"input_{i}"] for i in range(len(hashes_page))]
        except (OSError, ValueError, KeyError) as e:
            raise StepError(f"{path} is not a hard-example dataset: {e}", retry=False) from e
        if not len(inputs) == len(hashes_page) == len(predicted):
            raise StepError(f"{path}: arrays of different lengths", retry=False)
        for x, h, p in zip(inputs, hashes_page, predicted, strict=True):
            row = np.asarray(x, dtype=np.float32).reshape(-1)
            if row.size == N_FEATURES and np.isfinite(row).all():
                rows.append(row)
                hashes.append(h)
                answers.append(int(p))
    inputs_all = np.stack(rows) if rows else np.zeros((0, N_FEATURES), np.float32)
    return HardExamples(inputs_all, hashes, np.asarray(answers, dtype=np.int64))


def read_annotations(path: Path | None) -> dict[str, int]:
    """``{sha256 of an input's raw bytes: class}`` from the annotations file.

    Raises:
        StepError: no file was given, it cannot be read, or an entry is malformed.
    """
    if path is None:
        raise StepError(
            "no --annotations file: hard examples need labels a person gives; not training",
            retry=False,
        )
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        found = json.loads(raw) if len(raw) <= MAX_JSON_BYTES else None
    except (OSError, ValueError) as e:
        raise StepError(f"--annotations {path}: {e}", retry=True) from e
    if not isinstance(found, dict):
        raise StepError(f"--annotations {path}: not a JSON object within 16 MiB", retry=False)
    labels: dict[str, int] = {}
    for key, value in found.items():
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < N_CLASSES
        if not (_SHA256.fullmatch(key) and ok):
            raise StepError(f"--annotations {path}: bad entry {key[:70]!r}", retry=False)
        labels[key] = value
    return labels


def digits_split(seed: int = 0) -> tuple[FloatArray, IntArray, FloatArray, IntArray]:
    """scikit-learn's digits as float32 pixels in [0, 1], split 75/25 by ``seed``, stratified:
    the split ``mcp_edge.tooling.models.train_digits_mlp`` trains the demo's versions on."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        pixels, labels, test_size=0.25, random_state=seed, stratify=labels
    )
    return x_train, y_train, x_test, y_test


def train_mlp(x: FloatArray, y: IntArray, hidden_units: int, seed: int = 0) -> Any:
    """A one-hidden-layer ReLU MLP fitted on ``x``, ``y`` (a few seconds for the digits)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    model = MLPClassifier(
        hidden_layer_sizes=(hidden_units,), activation="relu", max_iter=1000, random_state=seed
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x, y)
    return model


# ---------------------------------------------------------------------------- one retraining
class Retrainer:
    """Runs the steps of the module docstring for one trigger at a time."""

    def __init__(self, config: Config, control_plane: ControlPlane) -> None:
        self.config = config
        self.cp = control_plane

    def run(self, trigger: Trigger) -> None:
        """Retrain for ``trigger``; raises StepError naming the step that failed."""
        work = self.config.work_dir / f"trigger-{trigger.id}"
        if (work / "result.json").exists():
            log.info(
                "trigger %d: done before (%s); nothing to do", trigger.id, work / "result.json"
            )
            return
        work.mkdir(parents=True, exist_ok=True)
        examples = self.fetch(trigger, work)
        x, y, x_hard_test, y_hard_test, deployed_right = self.label(trigger, examples)
        version = self.plan(trigger, work)
        bundle = work / f"{self.config.model}-{version}.mcpb"
        if not bundle.exists():
            onnx = self.train(
                trigger, work, version, x, y, x_hard_test, y_hard_test, deployed_right
            )
            self.build(trigger, work, version, onnx, bundle)
        self.push(trigger, bundle)
        rollout = self.roll_out(trigger, version)
        note = f"retrained as {self.config.model} {version}; rollout {rollout}"
        try:
            self.cp.call("POST", f"/api/v1/drift/triggers/{trigger.id}/acknowledge", {"note": note})
            log.info("trigger %d: acknowledged: %s", trigger.id, note)
        except StepError as e:
            log.warning("trigger %d: could not acknowledge it (%s); carrying on", trigger.id, e)
        result = {"trigger": trigger.id, "model": self.config.model, "version": version}
        result["rollout"] = rollout
        atomic_write_bytes(work / "result.json", json.dumps(result).encode() + b"\n")

    def fetch(self, trigger: Trigger, work: Path) -> HardExamples:
        base = f"/api/v1/drift/triggers/{trigger.id}/hard-examples"
        if not (work / "hard-examples-1.npz").exists():
            try:
                got = self.cp.call("POST", f"{base}/collect", {})
                log.info(
                    "trigger %d: asked %d device(s) for hard examples: %s stored, %s duplicates",
                    trigger.id, len(got.get("devices", [])), got.get("stored"),
                    got.get("duplicates"),
                )  # fmt: skip
            except StepError as e:
                if e.retry:
                    raise
                log.warning(
                    "trigger %d: collecting failed (%s); taking what is stored", trigger.id, e
                )
        pages: list[Path] = []
        after, total_bytes = 0, 0
        while len(pages) * PAGE_LIMIT < MAX_EXAMPLES:
            page = work / f"hard-examples-{len(pages) + 1}.npz"
            if not page.exists():
                query = urllib.parse.urlencode({"after_id": after, "limit": PAGE_LIMIT})
                total_bytes += self.cp.download(f"{base}.npz?{query}", page)
            pages.append(page)
            with np.load(page, allow_pickle=False) as npz:
                ids = np.asarray(npz["ids"], dtype=np.int64)
            if len(ids) < PAGE_LIMIT:
                break
            after = int(ids.max())
        examples = read_dataset(pages)
        if len(examples.inputs) == 0:
            raise StepError("the trigger has no hard examples (devices offline?)", retry=True)
        log.info(
            "trigger %d: downloaded %d hard examples of %s %s (%d bytes) into %s",
            trigger.id, len(examples.inputs), trigger.model, trigger.version, total_bytes, work,
        )  # fmt: skip
        return examples

    def label(
        self, trigger: Trigger, examples: HardExamples
    ) -> tuple[FloatArray, IntArray, FloatArray, IntArray, int]:
        """The training set (original + 3/4 of the labelled hard examples), the held-out
        quarter, and how many of it the deployed version answered right."""
        labels = read_annotations(self.config.annotations)
        known = [i for i, h in enumerate(examples.sha256) if h in labels]
        if not known:
            raise StepError(
                f"none of {len(examples.sha256)} hard examples has a label in "
                f"{self.config.annotations}; not training",
                retry=False,
            )
        # Every fourth labelled example (in sha256 order, so the same on every run) is held out.
        known.sort(key=lambda i: examples.sha256[i])
        held = known[3::4]
        used = sorted(set(known) - set(held))
        y_hard = np.array([labels.get(h, -1) for h in examples.sha256], dtype=np.int64)
        x_train, y_train, _, _ = digits_split()
        x = np.concatenate([x_train, examples.inputs[used]])
        y = np.concatenate([y_train, y_hard[used]])
        deployed_right = int((examples.predicted[held] == y_hard[held]).sum())
        log.info(
            "trigger %d: %d of %d hard examples have a label in %s; %d to train on, %d held out",
            trigger.id, len(known), len(examples.sha256), self.config.annotations, len(used),
            len(held),
        )  # fmt: skip
        return x, y, examples.inputs[held], y_hard[held], deployed_right

    def plan(self, trigger: Trigger, work: Path) -> str:
        """The version to publish: kept in plan.json, else the next major version."""
        plan = work / "plan.json"
        if plan.exists():
            return str(json.loads(plan.read_text())["version"])
        found = self.cp.call("GET", f"/api/v1/models/{urllib.parse.quote(self.config.model)}")
        versions = [SemVer.parse(str(v["version"])) for v in found.get("versions", [])]
        newest = max(versions) if versions else SemVer.parse("0.0.0")
        version = f"{newest.major + 1}.0.0"
        atomic_write_bytes(plan, json.dumps({"version": version}).encode() + b"\n")
        return version

    def train(
        self,
        trigger: Trigger,
        work: Path,
        version: str,
        x: FloatArray,
        y: IntArray,
        x_held: FloatArray,
        y_held: IntArray,
        deployed_right: int,
    ) -> Path:
        from mcp_edge.tooling.models import write_digits_onnx

        started = time.monotonic()
        model = train_mlp(x, y, self.config.hidden_units)
        _, _, x_test, y_test = digits_split()
        original = float(model.score(x_test, y_test))
        right = int((model.predict(x_held) == y_held).sum()) if len(x_held) else 0
        onnx = write_digits_onnx(model, work / f"{self.config.model}-{version}.onnx")
        log.info(
            "trigger %d: trained %s %s (MLP, %d hidden units) on %d images in %.1f s: "
            "%.3f right on held-out digits; on %d held-out hard examples %d right "
            "(%s answered %d right)",
            trigger.id, self.config.model, version, self.config.hidden_units, len(x),
            time.monotonic() - started, original, len(x_held), right, trigger.version,
            deployed_right,
        )  # fmt: skip
        return onnx

    def build(self, trigger: Trigger, work: Path, version: str, onnx: Path, bundle: Path) -> None:
        (work / "labels.txt").write_text("".join(f"{d}\n" for d in range(N_CLASSES)))
        # The drift baseline is the original training images, the traffic the fleet is meant
        # to see: with the hard examples in it, ordinary traffic would look drifted from it.
        np.save(work / "baseline.npy", digits_split()[0])
        tmp = bundle.with_name(f".{bundle.name}.part")
        try:
            build_bundle(
                onnx,
                tmp,
                name=self.config.model,
                version=version,
                labels_path=work / "labels.txt",
                baseline_npy=work / "baseline.npy",
                metadata={"retrained_for": f"trigger {trigger.id} ({trigger.version})"},
            )
            signed = sign_bundle(tmp, read_private_key(self.config.publisher_key))
            os.replace(tmp, bundle)
        except (McpError, OSError) as e:
            raise StepError(f"building {bundle.name}: {e}", retry=False) from e
        finally:
            tmp.unlink(missing_ok=True)
        log.info(
            "trigger %d: built and signed %s (%d bytes, publisher key %s)",
            trigger.id, bundle, bundle.stat().st_size, (signed.signer_keyid or "?")[:16],
        )  # fmt: skip

    def push(self, trigger: Trigger, bundle: Path) -> None:
        try:
            status, answer = upload_bundle(
                self.config.control_plane, self.cp.token, bundle, timeout=120, progress=False
            )
        except UploadError as e:
            raise StepError(f"pushing {bundle.name}: {e}", retry=True) from e
        if status not in (200, 201) or not isinstance(answer, dict):
            error = answer.get("error") if isinstance(answer, dict) else answer
            retry = status >= 500 or status == 429
            raise StepError(f"pushing {bundle.name}: HTTP {status}: {error}", retry=retry)
        log.info(
            "trigger %d: pushed %s %s: %s",
            trigger.id, answer["model"], answer["version"],
            "published before with these bytes" if status == 200 else "published",
        )  # fmt: skip

    def roll_out(self, trigger: Trigger, version: str) -> int:
        """Start the version's rollout, or return the one already started; its id."""
        model = urllib.parse.quote(self.config.model)
        for r in self.cp.call("GET", f"/api/v1/rollouts?model={model}&limit=100")["items"]:
            if r["version"] == version:
                log.info(
                    "trigger %d: rollout %d of %s started before", trigger.id, r["id"], version
                )
                return int(r["id"])
        body = {**self.config.rollout, "model": self.config.model, "version": version}
        rollout = self.cp.call("POST", "/api/v1/rollouts", body)["rollout"]
        log.info(
            "trigger %d: started rollout %d of %s %s: %d stage(s), %d device(s)",
            trigger.id, rollout["id"], self.config.model, version, rollout["stages"],
            rollout["target_devices"],
        )  # fmt: skip
        return int(rollout["id"])


# ---------------------------------------------------------------------------- the webhook
class Receiver:
    """Checks, records and queues webhook deliveries; a worker thread does the retraining."""

    def __init__(self, config: Config, retrainer: Retrainer) -> None:
        self.config = config
        self.retrainer = retrainer
        self.journal = config.work_dir / "accepted.jsonl"
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.jobs: queue.Queue[Trigger] = queue.Queue()

    def resume(self) -> None:
        """Note the deliveries accepted before and queue their unfinished triggers."""
        if not self.journal.exists():
            return
        queued: set[int] = set()
        with self.journal.open("rb") as f:
            f.seek(max(0, self.journal.stat().st_size - MAX_JSON_BYTES))
            for line in f.read(MAX_JSON_BYTES).splitlines()[-SEEN_DELIVERIES:]:
                try:
                    entry = json.loads(line)
                    trigger = Trigger(
                        int(entry["trigger"]), str(entry["model"]), str(entry["version"]),
                        str(entry["delivery"]),
                    )  # fmt: skip
                except (ValueError, KeyError, TypeError):
                    log.warning("%s: skipped a malformed line", self.journal)
                    continue
                self._remember(trigger.delivery)
                done = self.config.work_dir / f"trigger-{trigger.id}" / "result.json"
                if trigger.id not in queued and not done.exists():
                    queued.add(trigger.id)
                    log.info("trigger %d: accepted before, not finished: taking it up", trigger.id)
                    self.jobs.put(trigger)

    def _remember(self, delivery: str) -> None:
        self.seen[delivery] = None
        if len(self.seen) > SEEN_DELIVERIES:
            self.seen.popitem(last=False)

    async def handle(self, request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return _answer(413, f"body over {MAX_BODY_BYTES} bytes")
        body = bytearray()
        async for chunk in request.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return _answer(413, f"body over {MAX_BODY_BYTES} bytes")
        header = request.headers.get(SIGNATURE_HEADER, "")
        if not verify_signature(
            self.config.secret, header, bytes(body), time.time(), self.config.tolerance_s
        ):
            return _answer(401, "bad or stale signature")
        delivery = request.headers.get(DELIVERY_HEADER, "")
        if not _DELIVERY.fullmatch(delivery):
            return _answer(400, f"{DELIVERY_HEADER} is not 32 hex digits")
        if delivery in self.seen:
            log.info("delivery %s seen before: not acted on again", delivery)
            return web.Response(status=200, text="duplicate\n")
        try:
            trigger = self._trigger(json.loads(body), delivery)
        except (ValueError, KeyError, TypeError) as e:
            return _answer(400, f"not a webhook event: {e}")
        if trigger is None:
            self._remember(delivery)
            event = request.headers.get(EVENT_HEADER, "?")[:64]
            log.info(
                "delivery %s (%s): not a trigger of %s; ignored", delivery, event, self.config.model
            )
            return web.Response(status=200, text="ignored\n")
        line = json.dumps({"delivery": delivery, "trigger": trigger.id, "model": trigger.model,
                           "version": trigger.version, "received_at": time.time()})  # fmt: skip
        try:
            with self.journal.open("a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            log.error("could not store delivery %s: %s", delivery, e)
            return _answer(503, "could not store the event; send it again later")
        self._remember(delivery)
        log.info(
            "trigger %d: accepted delivery %s (%s %s): retraining",
            trigger.id, delivery, trigger.model, trigger.version,
        )  # fmt: skip
        self.jobs.put(trigger)
        return web.Response(status=202, text="accepted\n")

    def _trigger(self, event: Any, delivery: str) -> Trigger | None:
        """The trigger ``event`` announces for our model, None for any other event.

        Raises ValueError, KeyError or TypeError for a body that is not a webhook event."""
        if not isinstance(event, dict) or not isinstance(event["data"], dict):
            raise TypeError("the body is not an object with a data object")
        if event["type"] != EVENT or event["data"].get("model") != self.config.model:
            return None
        data = event["data"]
        trigger_id, version = data["trigger_id"], data["version"]
        if not isinstance(trigger_id, int) or isinstance(trigger_id, bool) or trigger_id < 1:
            raise ValueError("data.trigger_id is not a positive integer")
        if not isinstance(version, str):
            raise TypeError("data.version is not a string")
        return Trigger(trigger_id, self.config.model, str(SemVer.parse(version)), delivery)

    def work(self) -> None:
        """The worker thread: retrain for each queued trigger, in order, forever."""
        while True:
            trigger = self.jobs.get()
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    self.retrainer.run(trigger)
                    break
                except StepError as e:
                    if not e.retry or attempt == ATTEMPTS:
                        log.error("trigger %d: %s; giving up on it", trigger.id, e)
                        break
                    delay = 5 * 2 ** (attempt - 1)
                    log.warning("trigger %d: %s; trying again in %d s", trigger.id, e, delay)
                    time.sleep(delay)
                except Exception:
                    log.exception("trigger %d: failed; giving up on it", trigger.id)
                    break


def _answer(status: int, text: str) -> web.Response:
    log.warning("refused a delivery with %d: %s", status, text)
    return web.Response(status=status, text=text + "\n")


# ---------------------------------------------------------------------------- command line
def _read_private_file(path: Path, what: str, min_bytes: int = 1) -> bytes:
    """The file's bytes less a trailing newline; refused when others may read or write it."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise SystemExit(f"{what} {path} is not a regular file")
        if st.st_mode & 0o007:
            raise SystemExit(f"{what} {path}: others have access to it (chmod 600 {path})")
        with path.open("rb") as f:
            data = f.read(4097).rstrip(b"\r\n")
    except OSError as e:
        raise SystemExit(f"{what} {path} cannot be read: {e.strerror or e}") from e
    if not min_bytes <= len(data) <= 4096:
        raise SystemExit(f"{what} {path} must hold {min_bytes} to 4096 bytes")
    return data


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def parse_config(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(
        prog="retrain_receiver.py",
        description="Receive the control plane's retraining webhook, retrain the model on its "
        "hard examples, publish the new version and start its rollout (see the module "
        "docstring: python -c 'help(...)' or read the file).",
    )
    parser.add_argument("--control-plane", default=os.environ.get("MCP_SERVER", "http://127.0.0.1:8080"),
                        metavar="URL", help="the control plane's base URL (default $MCP_SERVER, "
                        "else http://127.0.0.1:8080)")  # fmt: skip
    parser.add_argument("--token-file", type=Path, required=True,
                        help="file holding an API token with the operator role (mode 600)")  # fmt: skip
    parser.add_argument("--secret-file", type=Path, required=True,
                        help="the webhook's HMAC secret, the file the control plane's "
                        "[[webhooks]] secret_file names (mode 600)")  # fmt: skip
    parser.add_argument("--publisher-key", type=Path, required=True,
                        help="publisher private key that signs the new bundle (mcp-bundle keygen; "
                        "registered with `mcp-controlplane publishers add`)")  # fmt: skip
    parser.add_argument("--model", default="digits", help="the model to retrain (default digits)")
    parser.add_argument("--work-dir", type=Path, default=Path("retrain"),
                        help="datasets, models, bundles and the accepted-trigger journal "
                        "(default ./retrain)")  # fmt: skip
    parser.add_argument("--listen", type=_listen, default="127.0.0.1:9100", metavar="HOST:PORT",
                        help="where to receive webhooks, any path (default 127.0.0.1:9100)")  # fmt: skip
    parser.add_argument("--annotations", type=Path, default=None,
                        help="JSON object: sha256 of a hard example's input bytes -> its class "
                        "(what a person labelled); examples without one are left out")  # fmt: skip
    parser.add_argument("--group", default=None,
                        help="roll the new version out to this device group: a canary on 10 %% "
                        "(error rate and latency gates, 10 min bake), then the rest")  # fmt: skip
    parser.add_argument("--rollout-spec", type=Path, default=None,
                        help="JSON file: the rollout's REST body (target, stages, ...) without "
                        "model and version; replaces --group's default (docs/rollouts.md)")  # fmt: skip
    parser.add_argument("--hidden-units", type=int, default=48,
                        help="hidden units of the retrained MLP (default 48)")  # fmt: skip
    parser.add_argument("--tolerance-s", type=float, default=300.0,
                        help="how far a signature's time may be from this clock (default 300 s)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rollout_spec is not None:
        try:
            spec = json.loads(args.rollout_spec.read_bytes()[:MAX_JSON_BYTES])
        except (OSError, ValueError) as e:
            parser.error(f"--rollout-spec {args.rollout_spec}: {e}")
        if not isinstance(spec, dict):
            parser.error(f"--rollout-spec {args.rollout_spec}: not a JSON object")
    elif args.group is not None:
        spec = {"target": {"group": args.group}, "stages": DEFAULT_STAGES}
    else:
        parser.error("say where the new version goes: --group or --rollout-spec")
    host, port = args.listen
    if not args.publisher_key.is_file():
        parser.error(f"--publisher-key {args.publisher_key}: no such file")
    return Config(
        host=host,
        port=port,
        control_plane=args.control_plane,
        token=_read_private_file(args.token_file, "--token-file").decode("ascii", "replace"),
        secret=_read_private_file(args.secret_file, "--secret-file", min_bytes=32),
        publisher_key=args.publisher_key,
        model=args.model,
        work_dir=args.work_dir.resolve(),
        annotations=args.annotations.resolve() if args.annotations else None,
        rollout={k: v for k, v in spec.items() if k not in ("model", "version")},
        hidden_units=args.hidden_units,
        tolerance_s=args.tolerance_s,
    )


async def serve(config: Config) -> None:
    """Receive webhooks until SIGINT or SIGTERM; the worker thread ends with the process."""
    config.work_dir.mkdir(parents=True, exist_ok=True)
    receiver = Receiver(config, Retrainer(config, ControlPlane(config.control_plane, config.token)))
    receiver.resume()
    threading.Thread(target=receiver.work, name="retrain", daemon=True).start()
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/{path:.*}", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    log.info(
        "receiving %s webhooks for %s on http://%s:%d/ (control plane %s, work dir %s)",
        EVENT, config.model, config.host, config.port, config.control_plane, config.work_dir,
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        with contextlib.suppress(Exception):
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
