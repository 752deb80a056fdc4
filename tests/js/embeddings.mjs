// The node openai SDK's embeddings.create (base64 by default, decoded by the SDK) and
// the AI SDK's embedMany through @ai-sdk/openai-compatible, against a server:
// node embeddings.mjs URL TEXT... Prints one JSON line: each client's vectors and usage.
import OpenAI from 'openai';
import { embed, embedMany } from 'ai';
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';

const [baseURL, ...texts] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'unused', maxRetries: 0 });
const model = (await client.models.list()).data[0].id;
const created = await client.embeddings.create({ model, input: texts });

const provider = createOpenAICompatible({ name: 'ninfer', baseURL: `${baseURL}/v1` });
const many = await embedMany({ model: provider.embeddingModel(model), values: texts, maxRetries: 0 });
const one = await embed({ model: provider.embeddingModel(model), value: texts[0], maxRetries: 0 });

console.log(
  JSON.stringify({
    openai: {
      vectors: created.data.map((d) => d.embedding),
      indexes: created.data.map((d) => d.index),
      usage: created.usage,
    },
    embedMany: { vectors: many.embeddings, tokens: many.usage.tokens },
    embed: { vector: one.embedding },
  }),
);
