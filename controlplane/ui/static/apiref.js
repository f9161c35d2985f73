// MCP Edge console, API reference page: a "Try it" form on each GET operation. It fills the
// operation's path and query parameters in, calls the API with the console's session cookie
// (the API takes it for GET requests) and shows the status and the answer as text.
"use strict";

(function () {
  var MAX_SHOWN = 200000; // characters of an answer shown; the rest is cut

  function target(form) {
    var path = form.getAttribute("data-path");
    var query = new URLSearchParams();
    var missing = [];
    form.querySelectorAll("[data-in]").forEach(function (field) {
      var value = field.value.trim();
      if (field.getAttribute("data-in") === "path") {
        if (!value) missing.push(field.name);
        path = path.split("{" + field.name + "}").join(encodeURIComponent(value));
      } else if (value) {
        if (field.hasAttribute("data-array")) {
          value.split(",").forEach(function (part) {
            if (part.trim()) query.append(field.name, part.trim());
          });
        } else {
          query.append(field.name, value);
        }
      }
    });
    var text = query.toString();
    return { url: path + (text ? "?" + text : ""), missing: missing };
  }

  function show(out, text) {
    out.hidden = false;
    out.textContent = text.length > MAX_SHOWN
      ? text.slice(0, MAX_SHOWN) + "\n… (" + (text.length - MAX_SHOWN) + " more characters)"
      : text;
  }

  function send(form) {
    var id = form.id;
    var status = document.getElementById(id + "-status");
    var out = document.getElementById(id + "-out");
    var request = target(form);
    if (request.missing.length) {
      status.textContent = "Fill in " + request.missing.join(", ") + ".";
      return;
    }
    status.textContent = "GET " + request.url + " …";
    fetch(request.url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (response) {
        var type = response.headers.get("Content-Type") || "";
        var line = "GET " + request.url + ": " + response.status + " " + response.statusText;
        if (type.indexOf("json") === -1 && type.indexOf("text/") !== 0) {
          return response.blob().then(function (blob) {
            status.textContent = line;
            show(out, "(" + blob.size + " bytes of " + (type || "unknown type") + ")");
          });
        }
        return response.text().then(function (body) {
          status.textContent = line;
          try {
            show(out, JSON.stringify(JSON.parse(body), null, 2));
          } catch (e) {
            show(out, body);
          }
        });
      })
      .catch(function (error) {
        status.textContent = "GET " + request.url + " failed: " + error;
      });
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("form.try-form").forEach(function (form) {
      form.parentNode.hidden = false;
      form.addEventListener("submit", function (ev) {
        ev.preventDefault();
        send(form);
      });
    });
  });
})();
