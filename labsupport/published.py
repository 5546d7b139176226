"""Published figures the book quotes that are not datasheet rows, each with its source.

GPU datasheet figures live in :mod:`labsupport.hardware`; model shapes in
:mod:`labsupport.models`. What is here was measured or stated by someone else, in a paper, and
the book quotes it beside the course's own numbers (chapter 07 explains the attention figures).
Chapter pages compute what they show from these values and the hardware table, never retype them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    what: str
    source: str


#: FlashAttention-2's forward pass uses about 35% of an H100's peak (FA3 paper's abstract).
FA2_H100_UTILISATION = Figure(
    0.35,
    "fraction of dense peak",
    "FlashAttention-2 forward pass on an H100 SXM5",
    "Shah et al., 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision', 2024",
)

#: FlashAttention-3's best fp16 forward pass on an H100 SXM5.
FA3_H100_FP16_FLOPS = Figure(
    740e12,
    "FLOP/s",
    "FlashAttention-3 forward pass, fp16, H100 SXM5 (their best case)",
    "Shah et al., 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision', 2024",
)

#: Throughput of the special-function units (MUFU: exp, log, ...) on an H100 SXM5.
H100_SPECIAL_FUNCTION_OPS = Figure(
    3.9e12,
    "operations/s",
    "special-function (MUFU) throughput of an H100 SXM5, exponentials included",
    "Shah et al., 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision', 2024",
)

# Tokenizers (chapter 01). Vocabulary sizes are the ``vocab_size`` of each model's config.json;
# Llama 3.1 8B's is in labsupport.models.

#: Llama 2's vocabulary (its config.json, ``vocab_size``).
LLAMA2_VOCAB_SIZE = Figure(
    32_000, "ids", "Llama 2's vocabulary (SentencePiece BPE)", "Llama 2 config.json (meta-llama/Llama-2-7b-hf)"
)

#: GPT-2's vocabulary (its config.json): 50,000 merges, 256 bytes and <|endoftext|>.
GPT2_VOCAB_SIZE = Figure(50_257, "ids", "GPT-2's byte-level BPE vocabulary", "GPT-2 config.json (openai-community/gpt2)")

#: Characters per token on a sample of English data, Llama 2's tokenizer (the Llama 3 report, section 3.2).
LLAMA2_ENGLISH_CHARS_PER_TOKEN = Figure(
    3.17,
    "characters per token",
    "Llama 2's tokenizer on a sample of English data",
    "Grattafiori et al., 'The Llama 3 Herd of Models', 2024, section 3.2",
)

#: The same for Llama 3's 128K tokenizer (100K tiktoken tokens plus 28K for other languages).
LLAMA3_ENGLISH_CHARS_PER_TOKEN = Figure(
    3.94,
    "characters per token",
    "Llama 3's tokenizer on a sample of English data",
    "Grattafiori et al., 'The Llama 3 Herd of Models', 2024, section 3.2",
)

#: Ids Llama 3 reserves for special tokens (<|begin_of_text|>, <|eot_id|>, ...), part of its 128,256.
LLAMA3_SPECIAL_TOKENS = Figure(
    256, "ids", "ids Llama 3 reserves for special tokens",
    "meta-llama/llama3, llama/tokenizer.py (num_reserved_special_tokens)",
)

#: Llama 3's ordinary (BPE) tokens: the ranks in its tiktoken ``tokenizer.model``; with the 256
#: special ids they make the 128,256 of its config.json.
LLAMA3_BPE_TOKENS = Figure(
    128_000, "ids", "Llama 3's BPE tokens (tiktoken mergeable ranks)",
    "meta-llama/llama3, llama/tokenizer.py (num_base_tokens = len(mergeable_ranks))",
)

#: Llama 3.1's first special tokens, in id order from ``LLAMA3_BPE_TOKENS`` (id 128,000) on; the
#: rest of its 256 are reserved. An id is 128,000 plus the position here.
LLAMA31_SPECIAL_TOKEN_ORDER = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
    "<|eot_id|>", "<|python_tag|>", "<|image|>",
)
LLAMA31_SPECIAL_TOKEN_SOURCE = "meta-llama/llama-models at a9c89c4, models/llama3/tokenizer.py (special_tokens)"
#: The tokens at which each model's reference code stops generating (``Tokenizer.stop_tokens``).
LLAMA3_STOP_TOKENS = ("<|end_of_text|>", "<|eot_id|>")
LLAMA3_STOP_TOKENS_SOURCE = "meta-llama/llama3 at 0053e6b, llama/tokenizer.py (stop_tokens)"
LLAMA31_STOP_TOKENS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
LLAMA31_STOP_TOKENS_SOURCE = LLAMA31_SPECIAL_TOKEN_SOURCE.replace("special_tokens", "stop_tokens")

#: Where they come from, in the report's round numbers: tokens of OpenAI's tiktoken tokenizer, and
#: tokens added for languages other than English.
LLAMA3_TIKTOKEN_TOKENS = Figure(
    100_000, "ids", "Llama 3 tokens taken from the tiktoken tokenizer ('100K')",
    "Grattafiori et al., 'The Llama 3 Herd of Models', 2024, section 3.2",
)
LLAMA3_ADDED_TOKENS = Figure(
    28_000, "ids", "Llama 3 tokens added for non-English languages ('28K')",
    "Grattafiori et al., 'The Llama 3 Herd of Models', 2024, section 3.2",
)

#: The largest gap in tokenised length between languages (the same text translated; FLORES-200)
#: across the tokenizers of deployed models.
PETROV_MAX_LENGTH_RATIO = Figure(
    15, "times", "largest ratio of tokenised lengths between languages for the same text",
    "Petrov, La Malfa, Torr and Bibi, 'Language Model Tokenizers Introduce Unfairness Between Languages', "
    "NeurIPS 2023 (abstract)",
)

# Models (chapter 02): mixtures of experts and a head width that is not d_model / n_heads.

#: Mixtral 8x7B's parameters: all of them, and those one token uses (2 of 8 experts per layer).
MIXTRAL_TOTAL_PARAMS = Figure(
    46.7e9, "parameters", "Mixtral 8x7B, all parameters",
    "Mistral AI, 'Mixtral of experts' (announcement), 11 December 2023",
)
MIXTRAL_ACTIVE_PARAMS = Figure(
    12.9e9, "parameters", "Mixtral 8x7B, parameters used per token",
    "Mistral AI, 'Mixtral of experts' (announcement), 11 December 2023",
)

#: Mixtral 8x7B's RoPE base: a hundred times Mistral 7B v0.1's (whose 10,000 is in labsupport.models).
#: Its attention has no sliding window: ``sliding_window`` is null in the same file, and the paper
#: describes "a fully dense context length of 32k tokens".
MIXTRAL_ROPE_THETA = Figure(
    1e6, "", "Mixtral 8x7B's RoPE base (rope_theta)",
    "config.json of mistralai/Mixtral-8x7B-v0.1 (rope_theta, sliding_window: null); transformers' MixtralConfig "
    "defaults to the same; Jiang et al., 'Mixtral of Experts', arXiv:2401.04088, 2024, section 2",
)

#: DeepSeek-V3: a mixture of experts far sparser than Mixtral.
DEEPSEEK_V3_TOTAL_PARAMS = Figure(
    671e9, "parameters", "DeepSeek-V3, all parameters", "DeepSeek-AI, 'DeepSeek-V3 Technical Report', 2024",
)
DEEPSEEK_V3_ACTIVE_PARAMS = Figure(
    37e9, "parameters", "DeepSeek-V3, parameters activated per token",
    "DeepSeek-AI, 'DeepSeek-V3 Technical Report', 2024",
)

#: Gemma 7B: 16 heads of 256 on a model width of 3,072 (Table 1 of the report).
_GEMMA = "Gemma Team, 'Gemma: Open Models Based on Gemini Research and Technology', 2024, Table 1"
GEMMA_7B_D_MODEL = Figure(3072, "", "Gemma 7B model width d_model", _GEMMA)
GEMMA_7B_HEADS = Figure(16, "", "Gemma 7B attention heads", _GEMMA)
GEMMA_7B_HEAD_DIM = Figure(256, "", "Gemma 7B head size", _GEMMA)

#: The dense FP8 tensor-core peak of an H100 SXM5: the datasheet gives 3,958 TFLOPS "with sparsity",
#: twice the dense figure (chapter 09 compares it with the dense bf16 peak in labsupport.hardware).
H100_FP8_DENSE_FLOPS = Figure(
    3958e12 / 2,
    "FLOP/s",
    "dense FP8 tensor-core peak, H100 SXM5 (half the datasheet's 'with sparsity' 3,958 TFLOPS)",
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
)

#: LLM.int8()'s threshold: feature dimensions with any activation of magnitude at least 6.0 go
#: through the 16-bit matmul, the rest through int8 (chapter 09).
LLM_INT8_OUTLIER_THRESHOLD = Figure(
    6.0,
    "activation magnitude",
    "outlier threshold of LLM.int8()'s mixed-precision decomposition",
    "Dettmers et al., 'LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale', NeurIPS 2022",
)

#: GGML's Q4_0 block (llama.cpp): one fp16 scale and 32 4-bit codes, 18 bytes per 32 weights.
GGML_Q4_0_BLOCK = Figure(
    18,
    "bytes per block of 32 weights",
    "GGML / llama.cpp Q4_0 block: an fp16 scale and 32 packed 4-bit codes",
    "llama.cpp, ggml-common.h (block_q4_0)",
)

#: Where LLM.int8() saw the large activation outliers emerge in every layer and most tokens.
LLM_INT8_EMERGENCE_PARAMS = Figure(
    6.7e9,
    "parameters",
    "model size from which systematic activation outliers appear in all layers (LLM.int8())",
    "Dettmers et al., 'LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale', NeurIPS 2022",
)

_KWON = "Kwon et al., 'Efficient Memory Management for Large Language Model Serving with PagedAttention', SOSP 2023"

#: Share of the reserved KV-cache memory that held token states in the contiguous-reservation
#: baselines of the vLLM paper's Figure 2 (averages over its section 6.2 experiment), lowest and
#: highest. The baselines are the authors' own reimplementation of Orca (not publicly available)
#: with three reservation policies: the maximum length (20.4%), a power of two above the real
#: output length, and an oracle that knows the output length (38.2%); the introduction quotes the
#: same range for "existing systems".
KWON_TOKEN_SHARE = (
    Figure(0.204, "fraction of reserved KV memory", "token states, Orca (Max): slabs of the maximum length",
           _KWON + ", Figure 2"),
    Figure(0.382, "fraction of reserved KV memory", "token states, Orca (Oracle): slabs of the true output length",
           _KWON + ", Figure 2"),
)

#: vLLM's throughput against FasterTransformer and Orca at the same latency (the paper's abstract).
KWON_THROUGHPUT_GAIN = (
    Figure(2, "x", "throughput gain over FasterTransformer and Orca, same latency, low end", _KWON + ", abstract"),
    Figure(4, "x", "throughput gain over FasterTransformer and Orca, same latency, high end", _KWON + ", abstract"),
)

#: H100 SXM's links: NVLink 4 between GPUs, PCIe Gen5 x16 to the host (both counted in both directions).
H100_NVLINK_BYTES_PER_S = Figure(
    900e9, "bytes/s, both directions together", "NVLink 4 on one H100 SXM",
    "NVIDIA H100 Tensor Core GPU datasheet",
)
PCIE_GEN5_X16_BYTES_PER_S = Figure(
    128e9, "bytes/s, both directions together", "PCIe Gen5 x16 on one H100",
    "NVIDIA H100 Tensor Core GPU datasheet",
)

#: Streaming multiprocessors of an H100 SXM5; the H200 SXM is the same GH100 GPU with more memory.
HOPPER_SXM_SMS = Figure(
    132,
    "streaming multiprocessors",
    "H100 SXM5 (GH100); the H200 SXM uses the same GPU",
    "NVIDIA H100 Tensor Core GPU Architecture whitepaper (H100 SXM5: 132 SMs)",
)

_MARLIN = ("Frantar, Castro, Chen, Hoefler and Alistarh, 'MARLIN: Mixed-Precision Auto-Regressive Parallel "
           "Inference on Large Language Models', PPoPP 2025, arXiv:2408.11743")

#: Batches up to which Marlin's fp16 x int4 kernel stays close to its ideal 4x speedup over fp16 (abstract).
MARLIN_NEAR_IDEAL_BATCH = (
    Figure(16, "tokens per batch", "Marlin close to the ideal speedup, low end", _MARLIN + ", abstract"),
    Figure(32, "tokens per batch", "Marlin close to the ideal speedup, high end", _MARLIN + ", abstract"),
)
