// The Vercel AI SDK (`ai` + `@ai-sdk/openai`) against the coordinator: `openai.chat(id)` is the chat
// completions API, `openai(id)` the Responses API (the provider's default), `openai.completion(id)`
// the legacy completions API, `openai.embedding(id)` embeddings. Same usage and output as
// openai_node.mjs (config JSON in argv[2], one JSON object of case results on stdout).
import { createOpenAI } from "@ai-sdk/openai";
import { APICallError, embed, generateObject, generateText, jsonSchema, streamText, tool } from "ai";
import { run } from "./cases.mjs";

const config = JSON.parse(process.argv[2]);
const M = config.model;
const provider = (key = config.key) => createOpenAI({ baseURL: config.base_url, apiKey: key });
const openai = provider();
const weather = { get_weather: tool({ description: "The weather in a city.", inputSchema: jsonSchema(config.weather_schema) }) };
const forceWeather = { type: "tool", toolName: "get_weather" };
const prompt = "Name one colour.";
const errorOf = (e) => {
  const api = APICallError.isInstance(e) ? e : APICallError.isInstance(e.lastError) ? e.lastError : null;
  return { name: e.constructor.name, isAPICallError: api !== null, status: api && api.statusCode,
    retryable: api && api.isRetryable, body: api && api.responseBody && api.responseBody.slice(0, 300),
    message: String(e.message).slice(0, 300) };
};

async function expectError(call) {
  try {
    await call();
  } catch (e) {
    return errorOf(e);
  }
  throw new Error("the request succeeded");
}

// streamText never throws: errors arrive as `error` parts of the full stream
async function streamed(options) {
  const result = streamText({ maxRetries: 0, ...options });
  const types = new Set();
  let text = "";
  for await (const part of result.fullStream) {
    types.add(part.type);
    if (part.type === "error") throw part.error;
    if (part.type === "text-delta") text += part.text;
  }
  return { text, types: [...types], usage: await result.usage, finishReason: await result.finishReason };
}

const toolCall = async (model) => {
  const r = await generateText({ model, maxRetries: 0, maxOutputTokens: 64, tools: weather, toolChoice: forceWeather,
    prompt: "What is the weather in Paris?" });
  return { toolCalls: r.toolCalls.map((c) => ({ toolName: c.toolName, input: c.input })), finishReason: r.finishReason };
};

await run({
  "429": () => expectError(() => generateText({ model: provider(config.limited_key).chat(M), prompt, maxRetries: 0,
    maxOutputTokens: 4 })),
  "401": () => expectError(() => generateText({ model: provider(config.bad_key).chat(M), prompt, maxRetries: 0 })),
  "404": () => expectError(() => generateText({ model: openai.chat("no-such-model"), prompt, maxRetries: 0 })),
  "402": () => expectError(() => generateText({ model: provider(config.broke_key).chat(M), prompt, maxRetries: 0,
    maxOutputTokens: 8 })),
  chat: async () => {
    const r = await generateText({ model: openai.chat(M), prompt, maxRetries: 0, maxOutputTokens: 12 });
    return { text: r.text, usage: r.usage, finishReason: r.finishReason };
  },
  stream: () => streamed({ model: openai.chat(M), prompt, maxOutputTokens: 12 }),
  structured: async () => {
    const r = await generateObject({ model: openai.chat(M), schema: jsonSchema(config.colour_schema), prompt,
      maxRetries: 0, maxOutputTokens: 48 });
    return { object: r.object };
  },
  "structured-responses": async () => {
    const r = await generateObject({ model: openai(M), schema: jsonSchema(config.colour_schema), prompt,
      maxRetries: 0, maxOutputTokens: 48 });
    return { object: r.object };
  },
  tool: () => toolCall(openai.chat(M)),
  responses: async () => {
    const r = await generateText({ model: openai(M), prompt, maxRetries: 0, maxOutputTokens: 12 });
    return { text: r.text, usage: r.usage, finishReason: r.finishReason };
  },
  "responses-stream": () => streamed({ model: openai(M), prompt, maxOutputTokens: 12 }),
  "responses-tool": () => toolCall(openai(M)),
  completions: async () => {
    const r = await generateText({ model: openai.completion(M), prompt: "Once upon a time", maxRetries: 0,
      maxOutputTokens: 8 });
    const s = await streamed({ model: openai.completion(M), prompt: "Once upon a time", maxOutputTokens: 8 });
    return { text: r.text, usage: r.usage, streamed: s.text };
  },
  embeddings: async () => {
    const r = await embed({ model: openai.embedding(M), value: "red", maxRetries: 0 });
    return { embedding: r.embedding, usage: r.usage };
  },
}, errorOf);
