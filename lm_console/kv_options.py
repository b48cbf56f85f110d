"""`lmc` flags for the KV connector: a raw --kv-transfer-config, or the OffloadConnector's settings."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

KVTransferConfigOpt = Annotated[Optional[str], typer.Option(
    "--kv-transfer-config", help='Engine kv_transfer_config as JSON, e.g. \'{"kv_connector": "OffloadConnector"}\'.')]
KVOffloadOpt = Annotated[bool, typer.Option(
    "--kv-offload/--no-kv-offload", help="Offload KV chunks to CPU RAM (and --kv-offload-disk) with the OffloadConnector.")]
KVOffloadDiskOpt = Annotated[Optional[str], typer.Option(
    "--kv-offload-disk", help="Disk tier directory (shared by engines on this machine, kept across restarts).")]
KVOffloadCpuBytesOpt = Annotated[int, typer.Option("--kv-offload-cpu-bytes", help="CPU tier size in bytes.")]
KVOffloadDiskBytesOpt = Annotated[int, typer.Option("--kv-offload-disk-bytes", help="Disk tier size in bytes.")]
KVChunkSizeOpt = Annotated[int, typer.Option("--kv-chunk-size", help="Tokens per offloaded chunk.")]
KVRoleOpt = Annotated[str, typer.Option("--kv-role", help="kv_both | kv_producer | kv_consumer.")]


def kv_transfer_args(kv_transfer_config: str | None = None, kv_offload: bool = False,
                     kv_offload_disk: str | None = None, kv_offload_cpu_bytes: int = 2 << 30,
                     kv_offload_disk_bytes: int = 16 << 30, kv_chunk_size: int = 256,
                     kv_role: str = "kv_both") -> dict[str, Any]:
    """{"kv_transfer_config": ...} for EngineArgs, or {} when no connector was asked for."""
    if kv_transfer_config:
        try:
            return {"kv_transfer_config": json.loads(kv_transfer_config)}
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"--kv-transfer-config is not valid JSON: {exc}") from None
    if not (kv_offload or kv_offload_disk):
        return {}
    extra: dict[str, Any] = {"cpu_bytes": kv_offload_cpu_bytes, "disk_bytes": kv_offload_disk_bytes,
                             "chunk_size": kv_chunk_size}
    if kv_offload_disk:
        extra["disk_path"] = kv_offload_disk
    return {"kv_transfer_config": {"kv_connector": "OffloadConnector", "kv_role": kv_role,
                                   "kv_connector_extra_config": extra}}
