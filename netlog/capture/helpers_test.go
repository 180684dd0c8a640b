//go:build linux

package capture

// Test fixtures: the sender and receiver children and their cgroups are internal/streamtest's; the loss
// injector is lab/labtest's.

import (
	"os"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/streamtest"
)

func TestMain(m *testing.M) {
	streamtest.ChildMain(nil, 2*time.Minute)
	os.Exit(m.Run())
}
