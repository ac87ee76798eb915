// llama-cli's chat prompts (its server's /v1/chat/completions path: common_chat_templates_apply with --jinja), on
// templates and conversations instead of a model: scripts/llamacpp_chat_render.py builds and runs this and writes
// tests/data/llamacpp_chat_render.json.
//
// stdin: one JSON object a line: {"template": SOURCE, "messages": [{"role", "content", "reasoning_content"?}, ...],
// "add_generation_prompt": bool, "reasoning": "auto" | "on" | "off", "preserve": null | bool (--reasoning-preserve),
// "effort": null | string (--reasoning-effort), "kwargs": {...} (--chat-template-kwargs)}. bos_token / eos_token are
// "<BOS>" / "<EOS>". stdout: one JSON object a line: {"prompt", "enable_thinking" (what llama-cli passes: reasoning not
// off and the template supports thinking), "supports_thinking"}.
#include "chat.h"
#include "common.h"
#include "json.h"

#include <nlohmann/json.hpp>

#include <iostream>
#include <map>
#include <string>

using json = nlohmann::ordered_json;

int main() {
    std::string line;
    while (std::getline(std::cin, line)) {
        if (line.empty()) {
            continue;
        }
        const json c = json::parse(line);
        json out;
        try {
            auto tmpls = common_chat_templates_init(nullptr, c.at("template").get<std::string>(), "<BOS>", "<EOS>");
            // as arg.cpp fills default_template_kwargs: --chat-template-kwargs (values as JSON), --reasoning-effort,
            // --reasoning-preserve, then preserve_reasoning = true where nothing set it
            std::map<std::string, std::string> kwargs;
            for (const auto & item : c.at("kwargs").items()) {
                kwargs[item.key()] = item.value().dump();
            }
            if (c.contains("effort") && c.at("effort").is_string()) {
                kwargs["reasoning_effort"] = json(c.at("effort").get<std::string>()).dump();
            }
            if (c.contains("preserve") && c.at("preserve").is_boolean()) {
                kwargs["preserve_reasoning"] = c.at("preserve").get<bool>() ? "true" : "false";
            }
            if (!kwargs.count("preserve_reasoning")) {
                kwargs["preserve_reasoning"] = "true";
            }
            // server-context.cpp: thinking unless --reasoning off, where the template supports it
            const bool supports = common_chat_templates_support_enable_thinking(tmpls.get());
            const std::string reasoning = c.at("reasoning").get<std::string>();
            common_chat_templates_inputs in;
            in.messages = common_chat_msgs_parse_oaicompat(common_json::parse(c.at("messages").dump()));
            in.add_generation_prompt = c.at("add_generation_prompt").get<bool>();
            in.use_jinja = true;
            in.reasoning_format = COMMON_REASONING_FORMAT_DEEPSEEK;
            in.enable_thinking = reasoning != "off" && supports;
            in.chat_template_kwargs = kwargs;
            // server-common.cpp: an enable_thinking kwarg overrides it
            const auto it = kwargs.find("enable_thinking");
            if (it != kwargs.end() && (it->second == "true" || it->second == "false")) {
                in.enable_thinking = it->second == "true";
            }
            const auto p = common_chat_templates_apply(tmpls.get(), in);
            out = {{"prompt", p.prompt}, {"enable_thinking", in.enable_thinking}, {"supports_thinking", supports}};
        } catch (const std::exception & e) {
            out = {{"error", e.what()}};
        }
        std::cout << out.dump() << "\n" << std::flush;
    }
    return 0;
}
