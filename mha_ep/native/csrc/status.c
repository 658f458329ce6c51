/* status.c: ORT's API table, as RegisterCustomOps was handed it (custom_op.c), and the statuses made and read
 * through it. */
#include "native.h"

const OrtApi* g_api = NULL;

OrtStatus* make_status(int code, const char* format, ...) {
  char message[2048];
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof message, format, args);
  va_end(args);
  return API(CreateStatusFn, API_CreateStatus)(code, message);
}

void release_status(OrtStatus* status) {
  if (status != NULL) API(ReleaseStatusFn, API_ReleaseStatus)(status);
}

/* ORT's status as text for one of our messages, released. */
void status_text(OrtStatus* status, char* out, size_t size) {
  snprintf(out, size, "%s", API(GetErrorMessageFn, API_GetErrorMessage)(status));
  release_status(status);
}
