"""``mcp-bundle``: build, sign, verify, inspect and push signed model bundles (.mcpb).

Errors follow the house style (:mod:`mcp_edge.shared.cli_style`): one line, ``Error:
<reason>``, on stderr and exit status 1 for a failure, 2 for a usage mistake; with ``--json``
one ``{"error", "code"}`` object. A file that is not a bundle at all is said to be so
(``Error: FILE is not an MCP bundle (why)``, code ``not_a_bundle``). Every option can also be
set with its ``MCP_<OPTION>`` environment variable. See docs/bundle-format.md.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from mcp_edge.shared import __version__, cli_style
from mcp_edge.shared.bundle import (
    BundleManifest,
    VariantSource,
    build_bundle,
    inspect_bundle,
    sign_bundle,
    verify_bundle,
)
from mcp_edge.shared.bundle._progress import progress_bar
from mcp_edge.shared.bundle.build import (
    QUANTIZE_CHOICES,
    describe_quantization,
    quantization_figures,
)
from mcp_edge.shared.bundle.manifest import MANIFEST_NAME
from mcp_edge.shared.bundle.quantize import QUANTIZE_MODES
from mcp_edge.shared.bundle.tarstream import BLOCK, TarStream
from mcp_edge.shared.bundle.upload import upload_bundle
from mcp_edge.shared.errors import BundleError, KeyFileError, McpError, SigningError
from mcp_edge.shared.signing import (
    PrivateKey,
    read_private_key,
    read_public_key,
    write_private_key,
    write_public_key,
)

_PATH = click.Path(path_type=Path, dir_okay=False)
_EXISTING = click.Path(path_type=Path, exists=True, dir_okay=False)


class CliError(click.ClickException):
    """A failure to report as ``Error: <message>`` (one line) with exit status 1; ``code`` is
    what ``--json`` reports."""

    def __init__(self, message: str, code: str = "failed") -> None:
        super().__init__(" ".join(message.split()))
        self.code = code


def _code(e: Exception) -> str:
    """The ``--json`` code of an expected failure."""
    kinds: list[tuple[type[Exception], str]] = [
        (BundleError, "bundle_invalid"),
        (KeyFileError, "key_file"),
        (SigningError, "signature"),
        (OSError, "file"),
    ]
    return next((code for kind, code in kinds if isinstance(e, kind)), "failed")


class _Group(cli_style.StyledGroup):
    prog = "mcp-bundle"
    failures = (McpError, OSError)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except McpError as e:
            raise CliError(str(e), _code(e)) from e
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise CliError(f"{where}{e.strerror or e}", _code(e)) from e


def not_a_bundle(path: Path) -> str | None:
    """Why the file at ``path`` is no bundle at all (the start of a bundle is a POSIX ustar
    header for ``manifest.json``), or None when it starts like one."""
    try:
        with path.open("rb") as f:
            head = f.read(BLOCK)
    except OSError:
        return None
    if head[:2] == b"\x1f\x8b":
        return "it is gzip-compressed; a bundle is an uncompressed tar archive"
    if head[:4] == b"PK\x03\x04":
        return "it is a zip archive"
    if not head:
        return "it is empty"
    if len(head) < BLOCK:
        return f"it is {len(head)} bytes long, shorter than one tar header"
    if head == bytes(BLOCK):
        return "it starts with an empty tar block"
    try:
        first = TarStream(io.BytesIO(head), lambda _: None, progress_bar(0, "", False))
        header = first.next_header()
    except BundleError:
        return "it does not start with a POSIX ustar header"
    if header is not None and header.name != MANIFEST_NAME:
        return f"its first member is {header.name!r}, not {MANIFEST_NAME}"
    return None


@contextmanager
def _about(path: Path) -> Iterator[None]:
    """Prefix errors with the bundle they concern; say so when the file is no bundle at all."""
    try:
        yield
    except BundleError as e:
        why = not_a_bundle(path)
        if why is not None:
            raise CliError(f"{path} is not an MCP bundle ({why})", "not_a_bundle") from e
        raise CliError(f"{path}: {e}", _code(e)) from e
    except McpError as e:
        raise CliError(f"{path}: {e}", _code(e)) from e


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mcp-bundle")
def cli() -> None:
    """Build, sign, verify, inspect and push MCP Edge model bundles (.mcpb).

    \b
    A typical release:
      mcp-bundle keygen --out publisher.key
      mcp-bundle build model.onnx --name digits --version 1.3.0 --labels labels.txt
      mcp-bundle sign digits-1.3.0.mcpb --key publisher.key
      mcp-bundle verify digits-1.3.0.mcpb --trusted-key publisher.pub
      mcp-bundle inspect digits-1.3.0.mcpb
      mcp-bundle push digits-1.3.0.mcpb --server https://cp.example:8080 --token $MCP_TOKEN

    Every option can also be set by the environment variable shown beside it in a command's
    --help (MCP_ and the option's name: --trusted-key is MCP_TRUSTED_KEY).
    """


@cli.command()
@click.option("--out", "out", type=_PATH, required=True, help="Private key file to write (0600).")
@click.option("--force", is_flag=True, help="Overwrite existing key files.")
def keygen(out: Path, force: bool) -> None:
    """Create a publisher key pair: OUT (private, mode 0600) and OUT with suffix .pub.

    \b
    Example:
      mcp-bundle keygen --out publisher.key     # writes publisher.key and publisher.pub
    """
    pub = out.with_suffix(".pub") if out.suffix == ".key" else out.with_name(out.name + ".pub")
    if pub.exists() and not force:
        raise CliError(f"{pub}: already exists; refusing to overwrite a key (use --force)")
    key = PrivateKey.generate()
    write_private_key(out, key, overwrite=force)
    write_public_key(pub, key.public_key)
    click.echo(f"wrote {out} (private, 0600) and {pub}; key id {key.keyid}")


def _split_pair(text: str, what: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise click.BadParameter(f"expected KEY=VALUE, got {text!r}", param_hint=what)
    return key.strip(), value.strip()


def _parse_variant(text: str) -> tuple[str, VariantSource]:
    tag, rest = _split_pair(text, "--variant")
    path, sep, profiles = rest.rpartition(":")
    if not sep:
        path, profiles = rest, ""
    if not path:
        raise click.BadParameter(f"no model file in {text!r}", param_hint="--variant")
    names = tuple(p.strip() for p in profiles.split(",") if p.strip())
    return tag, VariantSource(Path(path), names)


def _number(text: str) -> float:
    num, sep, den = text.partition("/")
    return float(num) / float(den) if sep else float(text)


def _parse_preprocess(text: str) -> dict[str, Any]:
    """JSON object, or ``[KIND:]key=value,...`` (size=HxW, scale may be a fraction 1/16)."""
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise click.BadParameter(f"invalid JSON: {e}", param_hint="--preprocess") from e
        if not isinstance(doc, dict):
            raise click.BadParameter("JSON must be an object", param_hint="--preprocess")
        return doc
    result: dict[str, Any] = {}
    head, sep, tail = text.partition(":")
    if sep and "=" not in head:
        result["kind"], text = head.strip(), tail
    try:
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, value = _split_pair(item, "--preprocess")
            if key == "size":
                h, _, w = value.lower().partition("x")
                result[key] = [int(h), int(w or h)]
            elif key in ("scale",):
                result[key] = _number(value)
            elif key in ("mean", "std"):
                result[key] = [_number(v) for v in value.split("/")]
            elif key == "grayscale":
                result[key] = value.lower() in ("1", "true", "yes", "on")
            else:
                result[key] = value
    except (ValueError, ZeroDivisionError) as e:
        raise click.BadParameter(f"{text!r}: {e}", param_hint="--preprocess") from e
    return result


def _parse_constraints(items: tuple[str, ...]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for item in items:
        key, value = _split_pair(item, "--constraint")
        if key == "min_memory_mb":
            try:
                result[key] = int(value)
            except ValueError:
                raise click.BadParameter(
                    f"min_memory_mb must be an integer, got {value!r}", param_hint="--constraint"
                ) from None
        elif key == "chip_affinity":
            result.setdefault(key, []).extend(v.strip() for v in value.split(",") if v.strip())
        elif key.startswith("min_runtime."):
            runtime = result.setdefault("min_runtime", {})
            runtime[key.removeprefix("min_runtime.")] = int(value) if value.isdigit() else value
        else:
            raise click.BadParameter(
                f"unknown constraint {key!r}; use min_memory_mb, chip_affinity or min_runtime.NAME",
                param_hint="--constraint",
            )
    return result


def _created() -> datetime | None:
    """Honour SOURCE_DATE_EPOCH (reproducible builds) for the ``created`` field."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if not epoch:
        return None
    try:
        return datetime.fromtimestamp(int(epoch), timezone.utc)
    except (ValueError, OverflowError, OSError) as e:
        raise CliError(f"SOURCE_DATE_EPOCH={epoch!r} is not a Unix time") from e


@cli.command()
@click.argument("model", type=_EXISTING)
@click.option("--name", required=True, help="Bundle name: 1-64 of a-z 0-9 . _ - .")
@click.option("--version", "version", required=True, help="Semantic version, e.g. 1.3.0.")
@click.option("--labels", type=_EXISTING, help="Class names, UTF-8, one per line.")
@click.option(
    "--variant",
    "variants",
    multiple=True,
    metavar="TAG=PATH[:PROFILE,...]",
    help="Extra model file for some hardware profiles (profiles default to TAG). Repeatable.",
)
@click.option("--baseline", type=_EXISTING, help="Samples [N, ...] (.npy) for the drift baseline.")
@click.option(
    "--preprocess",
    metavar="SPEC",
    help="JSON object, or e.g. image:layout=flat,size=8x8,scale=1/16,grayscale=true",
)
@click.option(
    "--constraint",
    "constraints",
    multiple=True,
    metavar="KEY=VALUE",
    help="min_memory_mb=N, chip_affinity=A[,B], min_runtime.NAME=V. Repeatable.",
)
@click.option("--meta", "meta", multiple=True, metavar="KEY=VALUE", help="metadata_props entry.")
@click.option(
    "--quantize",
    type=click.Choice(QUANTIZE_CHOICES),
    help="Add an INT8 variant (tag and profile int8) quantized from the ONNX model, with its "
    "measured accuracy cost in the manifest.",
)
@click.option(
    "--quantize-mode",
    type=click.Choice(QUANTIZE_MODES),
    help="static: calibrated on the --baseline samples; dynamic: MatMul/Gemm weights only "
    "[default: static with --baseline, else dynamic].",
)
@click.option(
    "--baseline-labels",
    type=_EXISTING,
    metavar="LABELS.npy",
    help="Integer class of each --baseline sample (.npy): --quantize also measures the "
    "accuracy change.",
)
@click.option("-o", "--out", type=_PATH, help="Output file [default: NAME-VERSION.mcpb].")
def build(
    model: Path,
    name: str,
    version: str,
    labels: Path | None,
    variants: tuple[str, ...],
    baseline: Path | None,
    preprocess: str | None,
    constraints: tuple[str, ...],
    meta: tuple[str, ...],
    quantize: str | None,
    quantize_mode: str | None,
    baseline_labels: Path | None,
    out: Path | None,
) -> None:
    """Validate MODEL (.onnx or .tflite) and write an unsigned bundle.

    The model is checked (ONNX: checker full check + strict shape inference; TFLite: the
    interpreter loads it) and its input/output signature is recorded in the manifest.
    Set SOURCE_DATE_EPOCH for a reproducible `created` time.

    --quantize int8 adds the variant int8 (models/model.int8.onnx), made with onnxruntime's
    quantization tools and measured against MODEL on the --baseline samples (top-1
    agreement, largest output difference, and with --baseline-labels the accuracy change).

    \b
    Examples:
      mcp-bundle build model.onnx --name digits --version 1.3.0
      mcp-bundle build model.onnx --name digits --version 1.3.0 --labels labels.txt \\
          --variant jetson-orin=model.fp16.onnx:jetson-orin,jetson-xavier \\
          --variant rpi=model.tflite:raspberry-pi --baseline samples.npy \\
          --preprocess image:layout=flat,size=8x8,scale=1/16,grayscale=true \\
          --constraint min_memory_mb=256 --meta team=vision -o digits.mcpb
      mcp-bundle build model.onnx --name digits --version 1.3.0 --baseline samples.npy \\
          --baseline-labels labels.npy --quantize int8
    """
    variant_map: dict[str, VariantSource] = {}
    for text in variants:
        tag, source = _parse_variant(text)
        if tag in variant_map:
            raise click.BadParameter(f"variant {tag!r} given twice", param_hint="--variant")
        variant_map[tag] = source
    out = out or Path(f"{name}-{version}.mcpb")
    manifest = build_bundle(
        model,
        out,
        name=name,
        version=version,
        labels_path=labels,
        variants=variant_map,
        baseline_npy=baseline,
        preprocessing=_parse_preprocess(preprocess) if preprocess else None,
        constraints=_parse_constraints(constraints),
        metadata=dict(_split_pair(m, "--meta") for m in meta),
        created=_created(),
        progress=True,
        quantize=quantize,
        quantize_mode=quantize_mode,
        calibration_labels=baseline_labels,
    )
    for v in manifest.variants:
        if v.quantization is not None:
            where = "" if baseline else " (seeded random inputs; --baseline gives real ones)"
            click.echo(describe_quantization(v.tag, v.quantization) + where, err=True)
    click.echo(
        f"wrote {out} ({_human_size(out.stat().st_size)}, {manifest.name} {manifest.version}, "
        f"{len(manifest.variants)} variant(s), unsigned)"
    )


@cli.command()
@click.argument("bundle", type=_EXISTING)
@click.option("--key", "key_path", type=_EXISTING, required=True, help="Publisher private key.")
@click.option("-o", "--out", type=_PATH, help="Write the signed bundle here [default: in place].")
@click.option(
    "--no-model-check", is_flag=True, help="Skip loading the models (hashes still checked)."
)
def sign(bundle: Path, key_path: Path, out: Path | None, no_model_check: bool) -> None:
    """Check BUNDLE and add (or replace) its manifest.sig, rewriting it atomically.

    \b
    Example:
      mcp-bundle sign digits-1.3.0.mcpb --key publisher.key
    """
    key = read_private_key(key_path)
    with _about(bundle):
        result = sign_bundle(bundle, key, out, validate_models=not no_model_check, progress=True)
    click.echo(
        f"signed {out or bundle} ({result.manifest.name} {result.manifest.version}) "
        f"with key {key.keyid[:16]}"
    )


@cli.command()
@click.argument("bundle", type=_EXISTING)
@click.option(
    "--trusted-key",
    "trusted",
    type=_EXISTING,
    multiple=True,
    help="Public key of a trusted publisher. Repeatable.",
)
@click.option("--allow-unsigned", is_flag=True, help="Accept a bundle without manifest.sig.")
@click.option(
    "--no-model-check", is_flag=True, help="Skip loading the models (hashes still checked)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify(
    bundle: Path,
    trusted: tuple[Path, ...],
    allow_unsigned: bool,
    no_model_check: bool,
    as_json: bool,
) -> None:
    """Check BUNDLE end to end: structure, caps, hashes, signature, models.

    Exit status 0 when every check passes, 1 (with the file at fault named) otherwise.

    \b
    Examples:
      mcp-bundle verify digits-1.3.0.mcpb --trusted-key publisher.pub
      mcp-bundle verify digits-1.3.0.mcpb --allow-unsigned
    """
    if not trusted and not allow_unsigned:
        raise click.UsageError("no trusted keys: pass --trusted-key PUB (or --allow-unsigned)")
    keys = [read_public_key(p) for p in trusted]
    with _about(bundle):
        result = verify_bundle(
            bundle,
            keys,
            require_signature=not allow_unsigned,
            validate_models=not no_model_check,
            progress=True,
        )
    m = result.manifest
    if as_json:
        click.echo(
            json.dumps(
                {
                    "ok": True,
                    "path": str(bundle),
                    "name": m.name,
                    "version": m.version,
                    "format": m.format,
                    "signer": result.signer_keyid,
                    "size": result.size,
                    "sha256": result.bundle_sha256,
                }
            )
        )
        return
    if result.signer_keyid:
        who = f"signed by {result.signer_keyid[:16]}"
    elif result.claimed_keyid:
        who = f"signature by {result.claimed_keyid[:16]} NOT checked (no trusted keys)"
    else:
        who = "unsigned"
    click.echo(
        f"OK {bundle}: {m.name} {m.version} ({m.format}), {who}, "
        f"{len(m.files)} file(s), {_human_size(result.size)}"
    )


def _render(info: dict[str, Any]) -> str:
    m = BundleManifest.model_validate_json(json.dumps(info["manifest"]))
    sig = info["signature"]
    lines = [
        f"{m.name} {m.version}  ({m.format}, {_human_size(info['size'])}, created {m.created})",
        "signer      "
        + (f"{sig['keyid']} (not verified; run `mcp-bundle verify`)" if sig else "unsigned"),
    ]
    lines += [f"input       {t.name} {t.datatype} {list(t.shape)}" for t in m.inputs]
    lines += [f"output      {t.name} {t.datatype} {list(t.shape)}" for t in m.outputs]
    if m.preprocessing:
        fields = m.preprocessing.model_dump(mode="json", exclude_defaults=True)
        lines.append("preprocess  " + " ".join(f"{k}={json.dumps(v)}" for k, v in fields.items()))
    if m.labels:
        lines.append(f"labels      {m.labels.file} ({m.labels.count} labels)")
    c = m.constraints
    parts = [f"min_memory_mb={c.min_memory_mb}"] if c.min_memory_mb is not None else []
    parts += [f"chip_affinity={','.join(c.chip_affinity)}"] if c.chip_affinity else []
    parts += [f"{k}={v}" for k, v in sorted(c.min_runtime.items())]
    if parts:
        lines.append("constraints " + " ".join(parts))
    lines += [f"meta        {k}={value}" for k, value in sorted(m.metadata_props.items())]
    lines.append("variants    TAG / FORMAT / SIZE / SHA256 / PROFILES")
    for v in m.variants:
        lines.append(
            f"  {v.tag:<14} {v.format:<7} {_human_size(v.size):>10}  {v.sha256[:16]}  "
            f"{','.join(v.profiles)}"
        )
        if v.quantization is not None:
            q = v.quantization
            lines.append(f"    {q.scheme} from {q.reference}: {quantization_figures(q)}")
    lines.append("files       PATH / SIZE / SHA256")
    for f in m.files:
        lines.append(f"  {f.path:<32} {_human_size(f.size):>10}  {f.sha256[:16]}")
    b = m.drift_baseline
    if b is not None:
        text = f"baseline    {b.sample_count} samples of {b.input!r}, {b.mode} ({b.feature_count} features)"
        if b.projections:
            text += f", sketch of {b.projections} projections (seed {b.projection_seed})"
        if b.output is not None:
            text += f"; output {b.output.output!r}: {len(b.output.class_counts)} classes"
        lines.append(text)
    return "\n".join(lines)


@cli.command()
@click.argument("bundle", type=_EXISTING)
@click.option("--json", "as_json", is_flag=True, help="Print manifest and signer as JSON.")
def inspect(bundle: Path, as_json: bool) -> None:
    """Show what BUNDLE holds, from its manifest (nothing is verified; use `verify`).

    \b
    Examples:
      mcp-bundle inspect digits-1.3.0.mcpb
      mcp-bundle inspect digits-1.3.0.mcpb --json | jq .manifest.variants
    """
    with _about(bundle):
        info = inspect_bundle(bundle)
    click.echo(json.dumps(info, indent=2, sort_keys=True) if as_json else _render(info))


DEFAULT_SERVER = "http://127.0.0.1:8080"


@cli.command()
@click.argument("bundle", type=_EXISTING)
@click.option(
    "--server",
    envvar="MCP_SERVER",
    show_envvar=True,
    default=DEFAULT_SERVER,
    show_default=True,
    help="Control plane base URL.",
)
@click.option(
    "--token",
    envvar="MCP_TOKEN",
    show_envvar=True,
    help="API token of an operator (from `mcp-controlplane init` or `login`).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=600.0,
    show_default=True,
    help="Seconds to wait on the network and for the server's checks.",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Show an upload progress bar [default: when stderr is a terminal].",
)
def push(
    bundle: Path, server: str, token: str | None, timeout: float, progress: bool | None
) -> None:
    """Upload a signed BUNDLE to the control plane, which checks its publisher signature and
    publishes it as a TUF target of its repository.

    Pushing the same bytes again changes nothing; another bundle with a published name and
    version is refused (publish a new version).

    \b
    Example:
      mcp-bundle push digits-1.3.0.mcpb --server https://cp.example:8080 --token $MCP_TOKEN
    """
    if not token:
        raise click.UsageError("no API token: pass --token or set MCP_TOKEN")
    with _about(bundle):
        info = inspect_bundle(bundle)
    if info["signature"] is None:
        raise CliError(
            f"{bundle}: not signed; sign it first with `mcp-bundle sign --key ...`", "unsigned"
        )
    show = sys.stderr.isatty() if progress is None else progress
    status, answer = upload_bundle(server, token, bundle, timeout=timeout, progress=show)
    if status >= 400:
        message = answer.get("error") if isinstance(answer, dict) else None
        raise CliError(f"{bundle}: {message or 'push failed'} (HTTP {status})", f"http_{status}")
    assert isinstance(answer, dict)
    if status == 200:
        click.echo(
            f"{answer['model']} {answer['version']} was already published with these "
            "bytes; nothing changed"
        )
        return
    click.echo(
        f"published {answer['model']} {answer['version']} ({_human_size(answer['length'])}, "
        f"sha256 {answer['sha256'][:16]}, signed by {answer['signer'][:16]}) as "
        f"{answer['target_path']}"
    )


cli_style.env_options(cli)


def main() -> None:
    """Console-script entry point."""
    cli()


if __name__ == "__main__":
    main()
