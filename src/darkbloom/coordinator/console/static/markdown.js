// A small Markdown renderer for model answers that builds DOM nodes directly. Every piece of the
// answer becomes a text node (or an element whose content is text), never parsed HTML, so an
// answer containing <script> or <img onerror=…> is shown as exactly those characters.

const SAFE_LINK = /^(https?:|mailto:)/i;

export function renderMarkdown(source) {
  const fragment = document.createDocumentFragment();
  const lines = source.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  let paragraph = [];

  const flushParagraph = () => {
    if (!paragraph.length) return;
    const p = document.createElement("p");
    paragraph.forEach((line, n) => {
      if (n) p.append(document.createElement("br"));
      p.append(...inline(line));
    });
    fragment.append(p);
    paragraph = [];
  };

  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```|~~~)\s*([\w+#.-]*)\s*$/);
    if (fence) {
      flushParagraph();
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i += 1; // the closing fence (absent while an answer is still streaming)
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      if (fence[2]) code.dataset.lang = fence[2];
      code.textContent = body.join("\n");
      pre.append(code);
      fragment.append(pre);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      flushParagraph();
      // answers sit under the page's own headings: # becomes h3 … ###### h6
      const level = Math.min(6, heading[1].length + 2);
      const el = document.createElement("h" + level);
      el.append(...inline(heading[2]));
      fragment.append(el);
      i += 1;
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      flushParagraph();
      fragment.append(document.createElement("hr"));
      i += 1;
      continue;
    }
    const listMatch = line.match(/^\s*([-*+]|\d{1,9}[.)])\s+/);
    if (listMatch) {
      flushParagraph();
      const ordered = /\d/.test(listMatch[1]);
      const list = document.createElement(ordered ? "ol" : "ul");
      if (ordered) {
        const start = parseInt(listMatch[1], 10);
        if (start !== 1) list.start = start;
      }
      while (i < lines.length) {
        const item = lines[i].match(/^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/);
        if (!item || /\d/.test(item[1]) !== ordered) break;
        const li = document.createElement("li");
        li.append(...inline(item[2]));
        list.append(li);
        i += 1;
      }
      fragment.append(list);
      continue;
    }
    if (/^\s*>/.test(line)) {
      flushParagraph();
      const quoted = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*>\s?/, ""));
      const quote = document.createElement("blockquote");
      quote.append(renderMarkdown(quoted.join("\n")));
      fragment.append(quote);
      continue;
    }
    if (!line.trim()) {
      flushParagraph();
      i += 1;
      continue;
    }
    paragraph.push(line);
    i += 1;
  }
  flushParagraph();
  return fragment;
}

const INLINE = [
  { kind: "code", re: /`([^`\n]+)`/ },
  { kind: "link", re: /\[([^\]\n]+)\]\(([^)\s]+)\)/ },
  { kind: "strong", re: /\*\*(?=\S)([^*\n]*?\S)\*\*|(?<!\w)__(?=\S)([^_\n]*?\S)__(?!\w)/ },
  { kind: "del", re: /~~(?=\S)([^~\n]*?\S)~~/ },
  { kind: "em", re: /\*(?=[^\s*])([^*\n]*?[^\s*])\*|(?<![\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?![\w])/ },
];

/** Inline spans as nodes: code, links (http, https, mailto only), bold, italics, strikethrough. */
export function inline(text) {
  const nodes = [];
  let rest = text;
  while (rest) {
    let best = null;
    for (const rule of INLINE) {
      const m = rule.re.exec(rest);
      if (m && (best === null || m.index < best.m.index)) best = { rule, m };
    }
    if (!best) {
      nodes.push(document.createTextNode(rest));
      break;
    }
    const { rule, m } = best;
    if (m.index) nodes.push(document.createTextNode(rest.slice(0, m.index)));
    const inner = m[1] !== undefined ? m[1] : m[2];
    if (rule.kind === "code") {
      const code = document.createElement("code");
      code.textContent = inner;
      nodes.push(code);
    } else if (rule.kind === "link") {
      const href = m[2];
      if (SAFE_LINK.test(href)) {
        const a = document.createElement("a");
        a.href = href;
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        a.append(...inline(inner));
        nodes.push(a);
      } else {
        nodes.push(document.createTextNode(m[0]));
      }
    } else {
      const el = document.createElement(rule.kind);
      el.append(...inline(inner));
      nodes.push(el);
    }
    rest = rest.slice(m.index + m[0].length);
  }
  return nodes;
}
