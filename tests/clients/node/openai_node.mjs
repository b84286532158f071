// openai-node against the coordinator: every case of the matrix, one process. Usage:
//   node openai_node.mjs '{"base_url": ".../v1", "key": "dk-…", "model": "…", "bad_key": …, "broke_key": …,
//                          "limited_key": …, "colour_schema": {…}, "weather_schema": {…}}'
// Prints one JSON object: case → {ok: true, value} | {ok: false, error: {name, status, code, type, message}}.
// The Python test (tests/clients/test_node_clients.py) asserts on it.
import OpenAI from "openai";
import { run } from "./cases.mjs";

const config = JSON.parse(process.argv[2]);
const M = config.model;
const client = (key = config.key) => new OpenAI({ baseURL: config.base_url, apiKey: key, maxRetries: 0 });
const oai = client();
const colourFormat = { type: "json_schema", json_schema: { name: "colour", schema: config.colour_schema, strict: true } };
const weatherTool = { type: "function", function: { name: "get_weather", description: "The weather in a city.",
  parameters: config.weather_schema, strict: true } };
const forceWeather = { type: "function", function: { name: "get_weather" } };
const ask = [{ role: "user", content: "Name one colour." }];
const errorOf = (e) => ({ name: e.constructor.name, status: e.status, code: e.code, type: e.type,
  isAPIError: e instanceof OpenAI.APIError, message: String(e.message).slice(0, 300) });

async function expectError(call, errorClass) {
  try {
    await call();
  } catch (e) {
    return { ...errorOf(e), isExpectedClass: errorClass === undefined || e instanceof errorClass };
  }
  throw new Error("the request succeeded");
}

await run({
  // first: the limited key's one request this minute is already spent
  "429": () => expectError(() => client(config.limited_key).chat.completions.create({ model: M, messages: ask,
    max_tokens: 4 }), OpenAI.RateLimitError),
  "401": () => expectError(() => client(config.bad_key).chat.completions.create({ model: M, messages: ask }),
    OpenAI.AuthenticationError),
  "404": () => expectError(() => oai.chat.completions.create({ model: "no-such-model", messages: ask }),
    OpenAI.NotFoundError),
  "402": () => expectError(() => client(config.broke_key).chat.completions.create({ model: M, messages: ask,
    max_tokens: 8 }), OpenAI.APIError),
  chat: async () => {
    const r = await oai.chat.completions.create({ model: M, messages: ask, max_tokens: 12 });
    return { model: r.model, object: r.object, content: r.choices[0].message.content,
      finish_reason: r.choices[0].finish_reason, usage: r.usage };
  },
  stream: async () => {
    const stream = await oai.chat.completions.create({ model: M, messages: ask, max_tokens: 12, stream: true });
    let text = "", chunks = 0, usage = null;
    for await (const c of stream) { text += c.choices[0].delta.content || ""; chunks++; usage = usage || c.usage || null; }
    return { text, chunks, usage };
  },
  usage: async () => {
    const stream = await oai.chat.completions.create({ model: M, messages: ask, max_tokens: 12, stream: true,
      stream_options: { include_usage: true } });
    const chunks = [];
    for await (const c of stream) chunks.push(c);
    const last = chunks[chunks.length - 1];
    return { last_choices: last.choices.length, usage: last.usage,
      usage_chunks: chunks.filter((c) => c.usage).length };
  },
  structured: async () => {
    const r = await oai.chat.completions.parse({ model: M, messages: ask, max_tokens: 48, response_format: colourFormat });
    return { parsed: r.choices[0].message.parsed, content: r.choices[0].message.content };
  },
  "structured-responses": async () => {
    const r = await oai.responses.parse({ model: M, input: "Name one colour.", max_output_tokens: 48,
      text: { format: { type: "json_schema", name: "colour", schema: config.colour_schema, strict: true } } });
    return { parsed: r.output_parsed };
  },
  tool: async () => {
    const r = await oai.chat.completions.parse({ model: M, max_tokens: 64, tools: [weatherTool], tool_choice: forceWeather,
      messages: [{ role: "user", content: "What is the weather in Paris?" }] });
    const call = r.choices[0].message.tool_calls[0];
    return { finish_reason: r.choices[0].finish_reason, name: call.function.name, id: call.id,
      arguments: call.function.arguments, parsed_arguments: call.function.parsed_arguments };
  },
  "tool-stream": async () => {
    const stream = oai.chat.completions.stream({ model: M, max_tokens: 64, tools: [weatherTool], tool_choice: "required",
      messages: [{ role: "user", content: "What is the weather in Paris?" }] });
    const r = await stream.finalChatCompletion();
    const call = r.choices[0].message.tool_calls[0];
    return { name: call.function.name, arguments: call.function.arguments };
  },
  responses: async () => {
    const r = await oai.responses.create({ model: M, input: "Name one colour.", instructions: "Answer briefly.",
      max_output_tokens: 12 });
    return { object: r.object, status: r.status, output_text: r.output_text, usage: r.usage,
      types: r.output.map((o) => o.type) };
  },
  "responses-stream": async () => {
    const stream = oai.responses.stream({ model: M, input: "Name one colour.", max_output_tokens: 12 });
    const types = [];
    let delta = "";
    for await (const e of stream) { types.push(e.type); if (e.type === "response.output_text.delta") delta += e.delta; }
    const final = await stream.finalResponse();
    // the stream helper's final response has no `output_text` convenience field: read the items
    const text = final.output.flatMap((o) => o.content || []).map((c) => c.text || "").join("");
    return { types, delta, output_text: text, status: final.status };
  },
  "responses-tool": async () => {
    const r = await oai.responses.create({ model: M, input: "What is the weather in Paris?", max_output_tokens: 64,
      tools: [{ type: "function", name: "get_weather", description: "The weather in a city.",
        parameters: config.weather_schema, strict: true }], tool_choice: { type: "function", name: "get_weather" } });
    const call = r.output.find((o) => o.type === "function_call");
    return { types: r.output.map((o) => o.type), name: call && call.name, arguments: call && call.arguments,
      call_id: call && call.call_id };
  },
  completions: async () => {
    const r = await oai.completions.create({ model: M, prompt: "Once upon a time", max_tokens: 8 });
    const stream = await oai.completions.create({ model: M, prompt: "Once upon a time", max_tokens: 8, stream: true });
    let streamed = "";
    for await (const c of stream) streamed += c.choices[0].text;
    return { object: r.object, text: r.choices[0].text, finish_reason: r.choices[0].finish_reason, usage: r.usage,
      streamed };
  },
  embeddings: async () => {
    const base64 = await oai.embeddings.create({ model: M, input: ["red", "blue"] });
    const float = await oai.embeddings.create({ model: M, input: "red", encoding_format: "float" });
    return { default: base64.data.map((d) => d.embedding), float: float.data[0].embedding, usage: base64.usage };
  },
}, errorOf);
