"""How long a prefill server keeps a finished request's KV blocks for the decode server: until the
decode server's Release, at most this long (the lease). The decode server sends Release again, while
the prefill server can't hear it, for as long: after that the lease has freed the blocks anyway."""

KV_LEASE_S = 60.0  # the decode side has the KV by then, or is gone
