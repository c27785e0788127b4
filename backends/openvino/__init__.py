"""The openvino backend: optimum-intel export, OpenVINO's paged attention, u8 KV cache, NNCF int8 weights."""
