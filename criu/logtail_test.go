package criu

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLogTail: a failed CRIU run's error carries the log's last error lines and, for a mapping the
// restorer could not make, what the log says of that mapping.
func TestLogTail(t *testing.T) {
	log := `(00.010000) Opening 0x007f90ec427000-0x007f90ec428000 0000000000000000 (41) vma
(00.010001) 6: vma 7f90ec427000 file /tmp/run/tmp/node2/hwloc.sm shared
(00.020000) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.134093) pie: 7: Error (criu/pie/restorer.c:1883): Can't restore 0x7f90ec427000 mapping with 0xfffffffffffffff3
(00.154100) Error (criu/cr-restore.c:2331): Restoring FAILED.
`
	path := filepath.Join(t.TempDir(), "restore.log")
	if err := os.WriteFile(path, []byte(log), 0o600); err != nil {
		t.Fatal(err)
	}
	got := logTail(path)
	if strings.Contains(got, "RLIMIT_NOFILE") {
		t.Errorf("logTail carries the rlimit line CRIU logs at every start without CAP_SYS_RESOURCE:\n%s", got)
	}
	for _, want := range []string{"Restoring FAILED", "Can't restore 0x7f90ec427000", "hwloc.sm shared", "Opening 0x007f90ec427000", "full log: " + path} {
		if !strings.Contains(got, want) {
			t.Errorf("logTail lacks %q:\n%s", want, got)
		}
	}
	if err := os.WriteFile(path, []byte("(00.1) pie: 7: Error (x): Can't restore \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := logTail(path); !strings.Contains(got, "Can't restore") {
		t.Errorf("logTail of a truncated line: %q", got)
	}
	// No error line (CRIU killed mid-run): the last lines say where it stopped.
	if err := os.WriteFile(path, []byte("(00.1) one\n(00.2) two\n(00.3) three\n(00.4) Restoring 7 mappings\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := logTail(path); !strings.Contains(got, "Restoring 7 mappings") || strings.Contains(got, "one") || !strings.Contains(got, "full log: "+path) {
		t.Errorf("logTail of a log without errors: %q", got)
	}
}
