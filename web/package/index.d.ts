// Types of lantern-web (index.js). The request and response shapes are OpenAI's.

export type ErrorCode =
  | 'no_adapter' | 'download_failed' | 'bad_model' | 'out_of_memory' | 'invalid_options'
  | 'invalid_request' | 'aborted' | 'not_loaded' | 'busy' | 'engine_error' | 'worker_failed'
  | 'context_length_exceeded' | 'kv_cache_too_small' | 'queue_full' | 'invalid_schema'
  | (string & {});

export declare class LanternError extends Error {
  name: 'LanternError';
  code: ErrorCode;
  /** For refused requests: the HTTP status `lantern serve` would answer. */
  status?: number;
  type?: string;
  param?: string | null;
}

export interface Progress {
  model: 'target' | 'draft';
  phase: 'download' | 'upload';
  done: number;
  total: number;
}

export interface EngineOptions {
  /** A catalogue name (`engine.models.list()`), a URL, a File, a Blob or the bytes. */
  model: string | File | Blob | Uint8Array;
  onProgress?: (p: Progress) => void;
  /** A draft model with the same tokenizer: requests speculate with it. */
  draft?: string | File | Blob;
  kvDtype?: 'f32' | 'f16' | 'q8' | 'q4';
  contextLength?: number;
  /** Bytes of GPU memory the model may take (weights, KV cache, workspace). */
  memoryBudget?: number;
  /** Requests decoded at once (default 4). */
  maxSeqs?: number;
  weights?: 'native' | 'f32' | 'f16';
  /** Where catalogue names are fetched from (default `models/` beside the page). */
  modelBase?: string;
  /** Where worker.js, lantern.js and lantern_bg.wasm are (default: beside this module). */
  assetBase?: string;
}

export interface ChatMessage {
  role: 'system' | 'user' | 'assistant' | 'tool';
  content: string | null | Array<{ type: 'text'; text: string }>;
  name?: string;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
}

export interface ToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

export interface Tool {
  type: 'function';
  function: { name: string; description?: string; parameters?: Record<string, unknown> };
}

export interface CommonParams {
  model?: string;
  max_tokens?: number;
  temperature?: number;
  top_p?: number;
  seed?: number;
  stop?: string | string[];
  n?: number;
  logprobs?: boolean | number;
  top_logprobs?: number;
  presence_penalty?: number;
  frequency_penalty?: number;
  logit_bias?: Record<string, number>;
  stream?: boolean;
  stream_options?: { include_usage?: boolean };
  /** Aborts the request and frees its sequence (the promise or iterator rejects with `aborted`). */
  signal?: AbortSignal;
}

export interface ChatParams extends CommonParams {
  messages: ChatMessage[];
  response_format?: { type: 'text' } | { type: 'json_object' } | { type: 'json_schema'; json_schema: { name?: string; schema: Record<string, unknown>; strict?: boolean } };
  tools?: Tool[];
  tool_choice?: 'none' | 'auto' | 'required' | { type: 'function'; function: { name: string } };
  max_completion_tokens?: number;
}

export interface CompletionParams extends CommonParams {
  prompt: string | string[] | number[];
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  prompt_tokens_details?: { cached_tokens: number };
}

export interface ChatCompletion {
  id: string;
  object: 'chat.completion';
  created: number;
  model: string;
  choices: Array<{
    index: number;
    message: { role: 'assistant'; content: string | null; tool_calls?: ToolCall[] };
    logprobs: unknown | null;
    finish_reason: 'stop' | 'length' | 'tool_calls' | 'cancelled' | string;
  }>;
  usage: Usage;
}

export interface ChatCompletionChunk {
  id: string;
  object: 'chat.completion.chunk';
  created: number;
  model: string;
  choices: Array<{
    index: number;
    delta: { role?: 'assistant'; content?: string | null; tool_calls?: Array<Partial<ToolCall> & { index: number }> };
    logprobs: unknown | null;
    finish_reason: string | null;
  }>;
  usage?: Usage | null;
}

export interface Completion {
  id: string;
  object: 'text_completion';
  created: number;
  model: string;
  choices: Array<{ index: number; text: string; logprobs: unknown | null; finish_reason: string }>;
  usage?: Usage | null;
}

export interface ChunkStream<T> extends AsyncIterableIterator<T> {
  /** Stop generating: the iteration ends and the sequence is freed. */
  abort(): void;
}

export interface CatalogueModel {
  name: string;
  file: string;
  bytes: number;
  family: string;
  params: string;
  format: string;
  license: string;
  default: boolean;
  url: string;
  cached: boolean;
}

export interface Engine {
  readonly modelId: string;
  /** Where the model was read from: network, cache, file, blob or bytes. */
  readonly source: string;
  chat: {
    completions: {
      create(p: ChatParams & { stream: true }): Promise<ChunkStream<ChatCompletionChunk>>;
      create(p: ChatParams & { stream?: false }): Promise<ChatCompletion>;
      create(p: ChatParams): Promise<ChatCompletion | ChunkStream<ChatCompletionChunk>>;
    };
  };
  completions: {
    create(p: CompletionParams & { stream: true }): Promise<ChunkStream<Completion>>;
    create(p: CompletionParams & { stream?: false }): Promise<Completion>;
    create(p: CompletionParams): Promise<Completion | ChunkStream<Completion>>;
  };
  models: {
    list(): Promise<CatalogueModel[]>;
    /** URLs of the models in Cache Storage. */
    cached(): Promise<string[]>;
    /** Remove a model (catalogue name or URL) from Cache Storage. */
    delete(nameOrUrl: string): Promise<boolean>;
  };
  /** A fetch answering /v1/chat/completions, /v1/completions and /v1/models in the page. */
  fetch: typeof fetch;
  tokenize(text: string): Promise<number[]>;
  detokenize(ids: ArrayLike<number>): Promise<string>;
  /** The memory plan: weights, KV cache, workspace, context, sequences, adapter. */
  plan(): Promise<Record<string, unknown>>;
  unload(): Promise<void>;
}

export declare function createEngine(options: EngineOptions): Promise<Engine>;
/** The catalogue before any model is loaded, each model with its URL and cached state. */
export declare function listModels(options?: { modelBase?: string; assetBase?: string }): Promise<CatalogueModel[]>;

export interface AdapterInfo {
  name: string;
  backend: string;
  device_type: string;
  driver: string;
  driver_info: string;
  capabilities: { shader_f16: boolean; subgroups: boolean; [k: string]: unknown };
  limits: Record<string, number>;
}
/** The browser's WebGPU adapter; rejects with a LanternError saying why when there is none. */
export declare function adapterInfo(options?: { assetBase?: string }): Promise<AdapterInfo>;
export declare function cachedModels(): Promise<string[]>;
