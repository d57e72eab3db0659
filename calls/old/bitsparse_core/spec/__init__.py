"""The format v1 specification in executable form, one module per group of sections of
docs/format.md: :mod:`.format` (§3-§6: constants, header, the size formula),
:mod:`.bitstream` and :mod:`.planes` (§5: the value streams, chunk offsets),
:mod:`.codec` (the reference pack / unpack), :mod:`.ops` (the fused ops' exact
semantics) and :mod:`.serialize` (§7-§8: buffers and the validator)."""
