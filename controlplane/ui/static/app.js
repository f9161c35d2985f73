// MCP Edge console: the only script every page loads. Progressive enhancement only: every page
// reads the same without it. It localises <time> elements, asks before dangerous actions
// (form[data-confirm]), keeps [data-live] regions current over server-sent events, fills live
// counts (input[data-count-url]) and copies text (button[data-copy]).
"use strict";

(function () {
  function localise(root) {
    root.querySelectorAll("time[datetime]").forEach(function (el) {
      var d = new Date(el.getAttribute("datetime"));
      if (!isNaN(d.getTime())) {
        el.textContent = d.toLocaleString();
        el.title = el.getAttribute("datetime");
      }
    });
  }

  function confirmForms(root) {
    root.querySelectorAll("form[data-confirm]").forEach(function (form) {
      if (form.dataset.bound) return;
      form.dataset.bound = "1";
      form.addEventListener("submit", function (ev) {
        if (!window.confirm(form.getAttribute("data-confirm"))) ev.preventDefault();
      });
    });
  }

  function enhance(root) {
    localise(root);
    confirmForms(root);
  }

  function live(el) {
    var url = el.getAttribute("data-live");
    if (!url || !window.EventSource) return;
    var source = new EventSource(url);
    source.addEventListener("update", function (ev) {
      var focused = document.activeElement && document.activeElement.id;
      el.innerHTML = ev.data;
      enhance(el);
      el.setAttribute("data-updated", String(Date.now()));
      if (focused) {
        var again = document.getElementById(focused);
        if (again) again.focus();
      }
    });
    source.addEventListener("end", function () { source.close(); });
  }

  function counts(input) {
    var url = input.getAttribute("data-count-url");
    var out = document.getElementById(input.getAttribute("data-count-out"));
    if (!url || !out) return;
    var timer = null;
    function ask() {
      var q = new URLSearchParams();
      q.set(input.name, input.value);
      fetch(url + "?" + q.toString(), { credentials: "same-origin" })
        .then(function (r) { return r.json(); })
        .then(function (body) { out.textContent = body.text; })
        .catch(function () { out.textContent = "could not count the devices"; });
    }
    input.addEventListener("input", function () {
      clearTimeout(timer);
      timer = setTimeout(ask, 200);
    });
    ask();
  }

  function copyButtons(root) {
    root.querySelectorAll("button[data-copy]").forEach(function (button) {
      button.hidden = false;
      button.addEventListener("click", function () {
        var source = document.getElementById(button.getAttribute("data-copy"));
        if (!source || !navigator.clipboard) return;
        navigator.clipboard.writeText(source.textContent.trim()).then(function () {
          button.textContent = "Copied";
        });
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    enhance(document);
    document.querySelectorAll("[data-live]").forEach(live);
    document.querySelectorAll("input[data-count-url]").forEach(counts);
    copyButtons(document);
  });
})();
