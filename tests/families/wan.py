"""Wan 2.1 / 2.2: WanTransformer3DModel (text in cross-attention). Its own cases (T2V, I2V, Wan 2.2
with two transformers, TI2V, VSA) are in tests/cases_wan.py and tests/cases_vsa.py."""

COVERED_ELSEWHERE = {"WanPipeline": "tests/test_wan_parallel.py", "WanImageToVideoPipeline": "tests/test_wan_parallel.py"}
