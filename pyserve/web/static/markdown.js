// A small Markdown renderer for model output, safe by construction: it builds DOM nodes and
// puts every piece of the text in text nodes, so nothing the model writes is ever parsed as
// HTML (no innerHTML anywhere). Links keep only http, https and mailto targets.
//
// Blocks: fenced code (``` or ~~~, with a language), headings, paragraphs (a line break stays
// one), bullet and numbered lists (nested by indentation), block quotes, rules and pipe tables.
// Inline: `code`, **bold**, *italic*, ~~strikethrough~~, [links](https://...), bare URLs and
// backslash escapes. An unclosed fence (an answer still streaming) runs to the end.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:\s+(.*)|$)/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const ESCAPABLE = "\\`*_{}[]()#+-.!|~>";
const SAFE_LINK = /^(https?:\/\/|mailto:)/i;
const BARE_URL = /^https?:\/\/[^\s<>"'`]*[^\s<>"'`.,;:!?)\]]/;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

function indentOf(line) {
  return line.length - line.trimStart().length;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

export function renderMarkdown(source) {
  const fragment = document.createDocumentFragment();
  blocks(source.replace(/\r\n?/g, "\n").split("\n"), fragment);
  return fragment;
}

function blocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i += 1;
    } else if ((m = FENCE.exec(line))) {
      i = codeBlock(lines, i, m, parent);
    } else if ((m = HEADING.exec(line))) {
      const heading = el(`h${m[1].length}`);
      inline(m[2], heading);
      parent.append(heading);
      i += 1;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(lines[i++].replace(QUOTE, ""));
      const quote = el("blockquote");
      blocks(quoted, quote);
      parent.append(quote);
    } else if (ITEM.test(line)) {
      i = list(lines, i, parent);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      i = table(lines, i, parent);
    } else {
      const paragraph = [];
      while (i < lines.length && lines[i].trim() && (paragraph.length === 0 || !startsBlock(lines[i]))) {
        paragraph.push(lines[i++].trim());
      }
      const p = el("p");
      paragraph.forEach((text, k) => {
        if (k) p.append(el("br"));
        inline(text, p);
      });
      parent.append(p);
    }
  }
}

function codeBlock(lines, start, match, parent) {
  const fence = match[1];
  const closing = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}\\s*$`);
  const indent = indentOf(lines[start]);
  const body = [];
  let i = start + 1;
  while (i < lines.length && !closing.test(lines[i])) {
    body.push(lines[i].slice(Math.min(indent, indentOf(lines[i]))));
    i += 1;
  }
  const language = match[2];
  const box = el("div", "code-block");
  const head = el("div", "code-head");
  head.append(language || "code");
  if (navigator.clipboard) {
    const copy = el("button");
    copy.type = "button";
    copy.textContent = "Copy";
    const text = body.join("\n");
    copy.addEventListener("click", async () => {
      await navigator.clipboard.writeText(text);
      copy.textContent = "Copied";
      setTimeout(() => { copy.textContent = "Copy"; }, 1500);
    });
    head.append(copy);
  }
  const pre = el("pre");
  const code = el("code", language ? `language-${language.replace(/[^\w+#.-]/g, "")}` : "");
  code.textContent = body.join("\n");
  pre.append(code);
  box.append(head, pre);
  parent.append(box);
  return i + 1; // past the closing fence (or the end)
}

function list(lines, start, parent) {
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const listEl = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) listEl.start = parseInt(first[2], 10);
  let i = start;
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const contentIndent = indent + m[2].length + 1;
    const item = [m[3] || ""];
    i += 1;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) {
        // A blank line keeps the item open only if what follows is indented into it.
        let k = i + 1;
        while (k < lines.length && !lines[k].trim()) k += 1;
        if (k < lines.length && indentOf(lines[k]) > indent) {
          item.push("");
          i += 1;
          continue;
        }
        break;
      }
      const sub = ITEM.exec(line);
      if (sub && sub[1].length <= indent) break; // the next item of this list, or of an outer one
      if (indentOf(line) > indent) {
        item.push(line.slice(Math.min(indentOf(line), contentIndent)));
      } else if (!startsBlock(line)) {
        item.push(line); // a lazy continuation of the item's text
      } else {
        break;
      }
      i += 1;
    }
    const li = el("li");
    blocks(item, li);
    // A one-paragraph item needs no paragraph box (a "tight" list).
    if (li.childElementCount === 1 && li.firstElementChild.tagName === "P") {
      li.replaceChildren(...li.firstElementChild.childNodes);
    } else if (li.firstElementChild && li.firstElementChild.tagName === "P") {
      li.firstElementChild.classList.add("lead");
    }
    listEl.append(li);
  }
  parent.append(listEl);
  return i;
}

function cells(row) {
  return row.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((cell) => cell.trim());
}

function table(lines, start, parent) {
  const header = cells(lines[start]);
  const aligns = cells(lines[start + 1]).map((rule) => {
    if (rule.startsWith(":") && rule.endsWith(":")) return "center";
    if (rule.endsWith(":")) return "right";
    return "";
  });
  const tableEl = el("table");
  const head = el("thead");
  const headRow = el("tr");
  header.forEach((text, k) => {
    const th = el("th");
    if (aligns[k]) th.style.textAlign = aligns[k];
    inline(text, th);
    headRow.append(th);
  });
  head.append(headRow);
  const body = el("tbody");
  let i = start + 2;
  while (i < lines.length && lines[i].trim() && lines[i].includes("|")) {
    const row = el("tr");
    const values = cells(lines[i]);
    header.forEach((_, k) => {
      const td = el("td");
      if (aligns[k]) td.style.textAlign = aligns[k];
      inline(values[k] || "", td);
      row.append(td);
    });
    body.append(row);
    i += 1;
  }
  tableEl.append(head, body);
  const wrap = el("div", "table-wrap");
  wrap.append(tableEl);
  parent.append(wrap);
  return i;
}

// The closing delimiter of an emphasis opened at `from`, or -1: the text inside may not start
// or end with a space, a single * or _ is not half of a double one, and _ closes only at a word
// boundary (so snake_case_names stay as they are).
function closingDelimiter(text, delim, from) {
  if (from >= text.length || /\s/.test(text[from])) return -1;
  let j = text.indexOf(delim, from);
  while (j !== -1) {
    const single = delim.length === 1;
    const doubled = single && (text[j + 1] === delim || text[j - 1] === delim);
    const boundary = delim[0] !== "_" || !/\w/.test(text[j + delim.length] || "");
    if (j > from && !/\s/.test(text[j - 1]) && !doubled && boundary) return j;
    j = text.indexOf(delim, j + 1);
  }
  return -1;
}

const EMPHASIS = [
  ["**", "strong"],
  ["__", "strong"],
  ["~~", "del"],
  ["*", "em"],
  ["_", "em"],
];

function inline(text, parent) {
  let buffer = "";
  const flush = () => {
    if (buffer) parent.append(buffer); // a string becomes a text node: never markup
    buffer = "";
  };
  let i = 0;
  outer: while (i < text.length) {
    const c = text[i];
    if (c === "\\" && i + 1 < text.length && ESCAPABLE.includes(text[i + 1])) {
      buffer += text[i + 1];
      i += 2;
      continue;
    }
    if (c === "`") {
      const run = /^`+/.exec(text.slice(i))[0];
      const end = text.indexOf(run, i + run.length);
      if (end !== -1) {
        flush();
        const code = el("code");
        code.textContent = text.slice(i + run.length, end).replace(/^ (.*) $/, "$1");
        parent.append(code);
        i = end + run.length;
      } else {
        buffer += run;
        i += run.length;
      }
      continue;
    }
    if (c === "[") {
      const m = /^\[([^\]]*)\]\(\s*<?([^\s)>]+)>?(?:\s+"[^"]*")?\s*\)/.exec(text.slice(i));
      if (m && SAFE_LINK.test(m[2])) {
        flush();
        parent.append(link(m[2], m[1] || m[2]));
        i += m[0].length;
        continue;
      }
    }
    if ((c === "h" || c === "H") && !/\w/.test(text[i - 1] || "")) {
      const m = BARE_URL.exec(text.slice(i));
      if (m) {
        flush();
        parent.append(link(m[0], null));
        i += m[0].length;
        continue;
      }
    }
    if (c === "*" || c === "_" || c === "~") {
      for (const [delim, tag] of EMPHASIS) {
        if (!text.startsWith(delim, i)) continue;
        if (delim[0] === "_" && /\w/.test(text[i - 1] || "")) continue; // inside a word
        const end = closingDelimiter(text, delim, i + delim.length);
        if (end === -1) continue;
        flush();
        const node = el(tag);
        inline(text.slice(i + delim.length, end), node);
        parent.append(node);
        i = end + delim.length;
        continue outer;
      }
    }
    buffer += c;
    i += 1;
  }
  flush();
}

function link(href, label) {
  const a = el("a");
  a.href = href;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  if (label === null) a.textContent = href;
  else inline(label, a);
  return a;
}
