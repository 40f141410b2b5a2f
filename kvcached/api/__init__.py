"""The daemon's external APIs (gRPC now; the agent socket later).

``STREAM_CHUNK_BYTES`` is the payload size of one GetStream/PutStream message: just under 1 MiB,
so a chunk plus its header fits the smallest message limit (grpc.max_message_mib = 1).
"""

STREAM_CHUNK_BYTES = (1 << 20) - 4096
