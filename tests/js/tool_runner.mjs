// The Anthropic TypeScript SDK's tool runner against a server: node tool_runner.mjs URL.
// Prints, as one JSON line, each assistant message's stop_reason and block types, and
// each tool call the runner ran.
import Anthropic from '@anthropic-ai/sdk';
import { betaTool } from '@anthropic-ai/sdk/helpers/beta/json-schema';

const [baseURL] = process.argv.slice(2);
const client = new Anthropic({ baseURL, apiKey: 'unused', maxRetries: 0 });
const model = (await client.models.list()).data[0].id;
const ran = [];
const getWeather = betaTool({
  name: 'get_weather',
  description: 'The weather in a city.',
  inputSchema: {
    type: 'object',
    properties: { city: { type: 'string', enum: ['Paris', 'Rome'] } },
    required: ['city'],
    additionalProperties: false,
  },
  run: async ({ city }) => {
    ran.push(city);
    return JSON.stringify({ city, weather: 'sunny' });
  },
});
const runner = client.beta.messages.toolRunner({
  model,
  max_tokens: 400,
  temperature: 0,
  messages: [{ role: 'user', content: 'weather in Paris?' }],
  tools: [getWeather],
  tool_choice: { type: 'any', disable_parallel_tool_use: true },
  max_iterations: 2,
});
const messages = [];
for await (const message of runner) {
  messages.push({ stop_reason: message.stop_reason, types: message.content.map((b) => b.type) });
}
console.log(JSON.stringify({ messages, ran }));
