"""A causal LM around a multimodal model's language model that transformers has only as a base model
(Qwen2-VL's `qwen2_vl_text`: no causal-LM class of its own), for `--text-only`.

It is what the multimodal model computes for text: the language model, then the output head
(tied to the embedding where the whole model ties it; `models._text_tower` sets the config's
tie_word_embeddings from the whole model), then transformers' own causal-LM loss. The parameter
count is checked against the whole model's language model and head when the model is resolved.
"""

from __future__ import annotations

from torch import nn
from transformers import AutoModel, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class TextTowerForCausalLM(PreTrainedModel, GenerationMixin):
    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = AutoModel.from_config(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_decoder(self) -> nn.Module:
        return self.model

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                **kwargs) -> CausalLMOutputWithPast:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, **kwargs).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
