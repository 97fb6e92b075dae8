"""scripts/fault_families.py's judge of a start that must fail: the outcome classes, and a
detail that says which line made an error unclear (the report is read to fix it)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import fault_families  # noqa: E402


def _judge(output, rc=1, says="disk"):
  return fault_families.judge_failure({"rc": rc, "output": output}, says)


def test_one_named_error_line_is_ok():
  assert _judge("step 5: loss 8.0\nerror: checkpoint 6: disk full\n") == (
      "ok", "error: checkpoint 6: disk full")


def test_a_traceback_is_named_by_its_exception_line_even_with_an_error_line():
  out = ("step 5\nException in thread save:\nTraceback (most recent call last):\n"
         '  File "x.py", line 1, in f\n    g()\nOSError: [Errno 27] File too large\n'
         "error: checkpoint 6: disk full\n")
  outcome, detail = _judge(out)
  assert outcome == "unclear error"
  assert "line 3" in detail and "OSError: [Errno 27] File too large" in detail
  assert "checkpoint 6" in detail


def test_two_error_lines_and_none_are_told_apart():
  outcome, detail = _judge("error: a disk\nerror: b disk\n")
  assert outcome == "unclear error" and detail.startswith("2 error lines")
  outcome, detail = _judge("something broke\n")
  assert outcome == "unclear error" and "no error line; last: something broke" in detail


def test_exit_0_and_timeouts():
  assert _judge("error: disk\n", rc=0)[0] == "silently wrong"
  assert _judge("", rc=None)[0] == "hang"
  assert _judge("error: something else\n")[0] == "unclear error"


def test_a_stop_signal_as_the_run_ends_is_ok_only_when_the_trainer_says_so():
  import signal
  import fault_injection
  summary = {"final_state_equal": True, "losses_equal": True, "evals_equal": True}
  kill = lambda code, said: {"last_step_logged": 60, "during_checkpoint_write": False,
                             "returncode": code, "leaked_processes": 0,
                             "said_run_ended": said, "next_start_resumed_from": 60,
                             "steps_lost": 0}
  outcomes = [f["outcome"] for f in fault_injection._kill_faults(
      signal.SIGTERM, [kill(143, False), kill(0, True), kill(0, False), kill(1, True)], summary)]
  assert outcomes == ["ok", "ok", "unclear error", "unclear error"]
